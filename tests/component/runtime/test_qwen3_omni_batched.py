"""Qwen3-Omni's stages serving batched (``engine_args.batching``, the default on accelerators), on the tiny
model on the CPU: the same decode-slot code the GPU runs, without CUDA graphs.

A lone greedy request still gives the whole model's text and waveform exactly (greedy thinker, sampling
talker and code predictor, same seed); requests sent together run in shared decode steps and each gets what
it gets alone, and streams sent together share code2wav's passes and each gets the audio it gets alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
from omni_helpers import (
    BATCH_PROMPTS,
    QWEN3,
    QWEN3_MARKS,
    USER,
    Qwen3Whole,
    alone_and_together,
    batched_steps,
    chat_body,
)
from runtime_procs import Served, served_in_process, wav_of

from omnimodel_runtime.engines.omni.common import CODES_KIND, tensor_frame
from omnimodel_runtime.protocol.stage import (
    FinalFrame,
    ResponseFrame,
    StageInput,
    StageParams,
    StageRequest,
    TensorFrame,
)
from omnimodel_runtime.serve import serve_pipeline

pytestmark = QWEN3_MARKS

MODEL = QWEN3
PROMPTS = BATCH_PROMPTS


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def serve(tiny_qwen3: Path, model_cache: Path) -> AsyncIterator[Served]:
    pipeline = serve_pipeline(
        MODEL, f"tiny://{MODEL}", device="cpu", engine_args={"batching": True, "max_batch_size": 4}
    )
    async with served_in_process(pipeline, model_cache, http_timeout=300) as served:
        yield served


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def greedy(tiny_qwen3: Path, model_cache: Path) -> AsyncIterator[Served]:
    """The same stages with a greedy talker (and code predictor). On the CPU a matrix product's rounding
    depends on how many rows it has (a step of four requests rounds each one's logits a little differently
    from a step of one), which may tip a sampled code now and then; an argmax stays put."""
    args = {"batching": True, "max_batch_size": 4, "talker_do_sample": False}
    pipeline = serve_pipeline(MODEL, f"tiny://{MODEL}", device="cpu", engine_args=args)
    async with served_in_process(pipeline, model_cache, http_timeout=300) as served:
        yield served


def body(prompt: str, **extra: Any) -> dict[str, Any]:
    return chat_body(MODEL, prompt, **{"max_tokens": 16, **extra})


@pytest.mark.slow
async def test_the_thinker_and_talker_serve_batched(serve: Served) -> None:
    assert serve.engine("thinker").batched
    assert serve.engine("thinker")._slots is not None
    assert serve.engine("talker").batched
    assert serve.engine("talker")._batch is not None


@pytest.mark.slow
async def test_a_lone_greedy_request_gets_the_whole_models_text(serve: Served, whole_qwen3: Qwen3Whole) -> None:
    resp = await serve.http.post("/v1/chat/completions", json={**body(""), "messages": USER})
    assert resp.status_code == 200, resp.text
    message = resp.json()["choices"][0]["message"]
    text, wav = whole_qwen3.generate(USER, speaker="Ethan", max_tokens=16, seed=5)
    assert message["content"] == text
    assert wav_of(message) == wav


@pytest.mark.slow
async def test_requests_sent_together_share_steps_and_each_gets_what_it_gets_alone(greedy: Served) -> None:
    rounds = await alone_and_together(greedy.http, [body(p) for p in PROMPTS])
    for single, message in zip(rounds.alone, rounds.together, strict=True):
        assert message["content"] == single["content"]
        assert wav_of(message) == wav_of(single)
    assert rounds.shared_steps("thinker") and rounds.shared_steps("talker")


async def voiced(engine: Any, codes: np.ndarray, request_id: str) -> list[np.ndarray]:
    """The audio pieces code2wav's ``engine`` streams for ``codes`` (steps x groups), one step's codes a frame
    as the talker sends them."""

    async def talker() -> AsyncIterator[ResponseFrame]:
        for step in codes:
            yield tensor_frame(CODES_KIND, {"codes": step})
            await asyncio.sleep(0)  # a turn for the other streams, as the talker's frames interleave
        yield FinalFrame("stop")

    request = StageRequest(request_id=request_id, prompt="", params=StageParams(audio_chunked=True))
    return [
        f.tensors["audio"]
        async for f in engine.generate(StageInput(request=request, upstream=talker()))
        if isinstance(f, TensorFrame)
    ]


@pytest.mark.slow
async def test_streams_sent_together_share_code2wav_passes_and_each_gets_its_audio_alone(serve: Served) -> None:
    engine = serve.engine("code2wav")
    assert engine.batched
    config = engine.model.config
    rng = np.random.default_rng(0)
    # 40 codes: a first chunk with less left context than the others, steady ones, and a short last one.
    streams = [rng.integers(0, config.codebook_size, (40, config.num_quantizers)) for _ in range(3)]
    alone = [await voiced(engine, codes, f"alone-{i}") for i, codes in enumerate(streams)]
    before = (await serve.http.get("/metrics")).text
    together = await asyncio.gather(*(voiced(engine, codes, f"together-{i}") for i, codes in enumerate(streams)))
    after = (await serve.http.get("/metrics")).text
    assert batched_steps(after, "code2wav") > batched_steps(before, "code2wav")
    for single, pieces in zip(alone, together, strict=True):
        assert len(pieces) == len(single) == 4  # chunks of 12 codes
        for a, b in zip(single, pieces, strict=True):
            assert a.shape == b.shape
            # The rounding of a matrix product over more rows (2.4e-7 seen), far below a 16-bit PCM step (3e-5).
            assert float(np.abs(a - b).max()) < 1e-5
