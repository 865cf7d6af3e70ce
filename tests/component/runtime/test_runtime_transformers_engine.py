"""The transformers text engine on the tiny Qwen2: batching, sampling, stopping, cancellation; every test
runs with both decode paths (``dynamic``: Hugging Face's cache; ``static``: slots of a static cache, the
CUDA-graph path, here eager on the CPU)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from omnimodel_runtime.engines.base import Engine, EngineContext
from omnimodel_runtime.engines.registry import create_engine
from omnimodel_runtime.errors import StageError
from omnimodel_runtime.protocol.stage import FinalFrame, SamplingParams, StageInput, StageRequest, TextFrame
from omnimodel_runtime.serve import serve_pipeline
from omnimodel_runtime.settings import RuntimeSettings

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="module")]

PROMPTS = [
    "hi",
    "Hello there, what is the model?",
    "Tell me a long story about a pod and a node in the cluster, with many words in it",
    "x " * 40,
]


class RecordingMetrics:
    def __init__(self) -> None:
        self.batches: list[int] = []
        self.tokens = 0

    def observe_batch(self, size: int) -> None:
        self.batches.append(size)

    def add_generated_tokens(self, count: int) -> None:
        self.tokens += count


def _engine(tiny_text: Path, metrics: RecordingMetrics, **engine_args: Any) -> Engine:
    pipeline = serve_pipeline("text", "tiny://text", engines=["transformers"], engine_args=engine_args, device="cpu")
    context = EngineContext(stage=pipeline.entry, model_dir=tiny_text, settings=RuntimeSettings(), metrics=metrics)
    return create_engine(context)


DECODES = ["dynamic", "static"]


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=DECODES)
async def engine(tiny_text: Path, request: pytest.FixtureRequest) -> AsyncIterator[tuple[Engine, RecordingMetrics]]:
    metrics = RecordingMetrics()
    eng = _engine(tiny_text, metrics, decode=request.param)
    await eng.start()
    await eng.warmup()
    yield eng, metrics
    await eng.stop()


async def run(eng: Engine, prompt: str, **sampling: Any) -> tuple[str, list[int], FinalFrame]:
    request = StageRequest(
        request_id=f"r{time.monotonic_ns()}",
        messages=({"role": "user", "content": prompt},),
        sampling=SamplingParams(**sampling),
    )
    text, ids, final = "", [], None
    async for frame in eng.generate(StageInput(request=request)):
        if isinstance(frame, TextFrame):
            text += frame.text
            ids.extend(frame.token_ids)
        elif isinstance(frame, FinalFrame):
            final = frame
    assert final is not None
    return text, ids, final


@pytest.mark.slow
async def test_greedy_generation_is_readable_and_accounted(engine: tuple[Engine, RecordingMetrics]) -> None:
    eng, _ = engine
    text, ids, final = await run(eng, "hi", max_tokens=24, temperature=0.0)
    assert final.finish_reason == "length"
    assert final.usage.completion_tokens == 24 == len(ids)
    assert final.usage.prompt_tokens > 3
    # The tiny model never emits lone UTF-8 fragments or control bytes (see tiny/text.py).
    assert text.isprintable()
    assert "\ufffd" not in text
    assert len(set(ids)) > 5  # random weights, but not one token repeated


@pytest.mark.slow
async def test_concurrent_requests_share_forward_passes_and_match_sequential_output(
    engine: tuple[Engine, RecordingMetrics],
) -> None:
    eng, metrics = engine
    lengths = [40, 8, 25, 3]
    alone = [await run(eng, p, max_tokens=n, temperature=0.0) for p, n in zip(PROMPTS, lengths, strict=True)]
    metrics.batches.clear()
    together = await asyncio.gather(
        *(run(eng, p, max_tokens=n, temperature=0.0) for p, n in zip(PROMPTS, lengths, strict=True))
    )
    # Left padding, cache merging and rows leaving early must not change any row's greedy output.
    for (a_text, a_ids, a_final), (b_text, b_ids, b_final) in zip(alone, together, strict=True):
        assert b_ids == a_ids
        assert b_text == a_text
        assert b_final == a_final
    assert max(metrics.batches) > 1
    # Four requests of 40+8+25+3 tokens took far fewer forward passes than 76.
    assert len(metrics.batches) < sum(lengths)


@pytest.mark.slow
async def test_seeded_sampling_is_reproducible_and_seed_dependent(engine: tuple[Engine, RecordingMetrics]) -> None:
    eng, _ = engine
    runs = await asyncio.gather(
        run(eng, "hello", max_tokens=30, temperature=1.0, seed=7),
        run(eng, "hello", max_tokens=30, temperature=1.0, seed=7),
        run(eng, "a different request in the same batch", max_tokens=30, temperature=1.0, seed=7),
    )
    again = await run(eng, "hello", max_tokens=30, temperature=1.0, seed=7)
    other = await run(eng, "hello", max_tokens=30, temperature=1.0, seed=8)
    assert runs[0][1] == runs[1][1] == again[1]
    assert other[1] != again[1]


@pytest.mark.slow
async def test_top_p_near_zero_is_greedy(engine: tuple[Engine, RecordingMetrics]) -> None:
    eng, _ = engine
    greedy = await run(eng, "hello", max_tokens=20, temperature=0.0)
    nucleus = await run(eng, "hello", max_tokens=20, temperature=1.0, top_p=1e-6, seed=1)
    assert nucleus[1] == greedy[1]


@pytest.mark.slow
async def test_stop_strings_end_generation_without_the_stop_text(engine: tuple[Engine, RecordingMetrics]) -> None:
    eng, _ = engine
    full, _, _ = await run(eng, "hi", max_tokens=40, temperature=0.0)
    stop = full[10:13]
    text, _, final = await run(eng, "hi", max_tokens=40, temperature=0.0, stop=(stop,))
    assert final.finish_reason == "stop"
    assert text == full[: full.index(stop)]


@pytest.mark.slow
async def test_a_closed_stream_leaves_the_batch(engine: tuple[Engine, RecordingMetrics]) -> None:
    eng, metrics = engine
    request = StageRequest(
        request_id="long", prompt="go", sampling=SamplingParams(max_tokens=3000, ignore_eos=True, temperature=0.0)
    )
    frames = eng.generate(StageInput(request=request))
    for _ in range(3):
        await anext(frames)
    await frames.aclose()  # what the stage server does when the caller disconnects
    metrics.batches.clear()
    await run(eng, "short", max_tokens=5, temperature=0.0)
    # Had the abandoned request stayed, the short one would have shared its steps (batch of 2).
    assert metrics.batches
    assert max(metrics.batches) == 1


@pytest.mark.slow
async def test_bad_requests_are_rejected_with_400(engine: tuple[Engine, RecordingMetrics]) -> None:
    eng, _ = engine
    with pytest.raises(StageError, match="maximum context length is 4096") as info:
        await run(eng, "hi", max_tokens=5000)
    assert info.value.status == 400
    with pytest.raises(StageError) as info:
        await run(eng, "word " * 5000)
    assert info.value.status == 400


@pytest.mark.slow
async def test_expired_deadline_is_a_504(engine: tuple[Engine, RecordingMetrics]) -> None:
    eng, _ = engine
    request = StageRequest(
        request_id="late", prompt="x", deadline=time.time() - 1, sampling=SamplingParams(max_tokens=50)
    )
    with pytest.raises(StageError) as info:
        async for _ in eng.generate(StageInput(request=request)):
            pass
    assert info.value.status == 504


@pytest.mark.slow
@pytest.mark.parametrize("decode", DECODES)
async def test_a_burst_waits_for_the_batch_window_and_starts_as_one_batch(tiny_text: Path, decode: str) -> None:
    metrics = RecordingMetrics()
    # A long window that closes as soon as the batch is full: the burst's arrival order and timing
    # cannot split it, so the assertion below is about behaviour, not speed.
    eng = _engine(tiny_text, metrics, max_batch_size=4, batch_wait=30.0, decode=decode)
    await eng.start()
    try:
        metrics.batches.clear()
        results = await asyncio.gather(*(run(eng, p, max_tokens=6, temperature=0.0) for p in PROMPTS))
        assert metrics.batches[0] == 4  # the prefill ran all four prompts together
        assert all(size == 4 for size in metrics.batches)
        assert all(r[2].usage.completion_tokens == 6 for r in results)
    finally:
        await eng.stop()


@pytest.mark.slow
async def test_a_request_whose_forward_pass_fails_fails_alone_in_its_batch(
    engine: tuple[Engine, RecordingMetrics], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per-request isolation inside a batch, past validation: with the vocabulary check switched off, an id
    beyond the embedding table reaches the prefill ("index out of range in self"). Only that request
    fails; the requests it arrived with and the ones already decoding finish with their own answers."""
    eng, _ = engine
    alone = [await run(eng, p, max_tokens=12, temperature=0.0) for p in PROMPTS]
    monkeypatch.setattr(eng, "_vocab_size", 10**9)

    async def bad() -> StageError:
        request = StageRequest(request_id="bad", prompt_token_ids=(1, 999_999), sampling=SamplingParams(max_tokens=4))
        with pytest.raises(StageError) as info:
            async for _ in eng.generate(StageInput(request=request)):
                pass
        return info.value

    async def later(prompt: str) -> tuple[str, list[int], FinalFrame]:
        await asyncio.sleep(0)  # joins the running batch a step later, with the bad one or after it
        return await run(eng, prompt, max_tokens=12, temperature=0.0)

    first, err, *rest = await asyncio.gather(
        run(eng, PROMPTS[0], max_tokens=12, temperature=0.0), bad(), *(later(p) for p in PROMPTS[1:])
    )
    assert "index out of range" in err.message
    assert [first, *rest] == alone


# Inductor's CPU code generation imports a torch.jit helper that warns about itself (torch 2.13).
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
async def test_a_compiled_static_decode_writes_what_the_eager_one_writes(tiny_text: Path) -> None:
    """``decode_compile`` (the default on CUDA, where the compiled layers are then captured as graphs): the
    same greedy text alone and in a batch, and one set of compiled graphs shared by every layer."""
    from torch._dynamo.utils import counters

    async def texts(eng: Engine) -> tuple[list[str], list[str]]:
        alone = [(await run(eng, p, max_tokens=12, temperature=0.0))[0] for p in PROMPTS]
        together = await asyncio.gather(*(run(eng, p, max_tokens=12, temperature=0.0) for p in PROMPTS))
        return alone, [t for t, _, _ in together]

    results = []
    graphs = counters["stats"]["unique_graphs"]
    for compiled in (False, True):
        eng = _engine(tiny_text, RecordingMetrics(), decode="static", decode_compile=compiled)
        await eng.start()
        try:
            results.append(await texts(eng))
        finally:
            await eng.stop()
    made = counters["stats"]["unique_graphs"] - graphs
    assert results[1] == results[0]
    assert all(results[0][0])
    # Two compiled functions (before and after the cache write), each once for a single row and once
    # shape-generic: not one per layer or per step shape.
    assert 2 <= made <= 4, made
