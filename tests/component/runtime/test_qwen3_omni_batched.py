"""Qwen3-Omni's stages serving batched (``engine_args.batching``, the default on accelerators), on the tiny
model on the CPU: the same decode-slot code the GPU runs, without CUDA graphs.

A lone greedy request still gives the whole model's text and waveform exactly (greedy thinker, sampling
talker and code predictor, same seed); requests sent together run in shared decode steps and each gets what
it gets alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest_asyncio
from omni_helpers import QWEN3, QWEN3_MARKS, USER, Qwen3Whole
from runtime_procs import Served, metric_total, served_in_process, wav_of

from omnimodel_runtime.serve import serve_pipeline

pytestmark = QWEN3_MARKS

MODEL = QWEN3
PROMPTS = ["Hello there, who are you?", "What is a pod?", "Tell me about the cluster.", "Why do engines batch?"]


def batched_steps(metrics: str, stage: str) -> float:
    """Steps of ``stage`` that served more than one request (from the batch-size histogram)."""
    total = metric_total(metrics, "omnimodel_batch_size_count", {"stage": stage})
    return total - metric_total(metrics, "omnimodel_batch_size_bucket", {"stage": stage, "le": "1.0"})


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
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "modalities": ["text", "audio"],
        "max_tokens": 16,
        "temperature": 0,
        "seed": 5,
        **extra,
    }


async def test_the_thinker_and_talker_serve_batched(serve: Served) -> None:
    assert serve.engine("thinker").batched
    assert serve.engine("thinker")._slots is not None
    assert serve.engine("talker").batched
    assert serve.engine("talker")._batch is not None


async def test_a_lone_greedy_request_gets_the_whole_models_text(serve: Served, whole_qwen3: Qwen3Whole) -> None:
    resp = await serve.http.post("/v1/chat/completions", json={**body(""), "messages": USER})
    assert resp.status_code == 200, resp.text
    message = resp.json()["choices"][0]["message"]
    text, wav = whole_qwen3.generate(USER, speaker="Ethan", max_tokens=16, seed=5)
    assert message["content"] == text
    assert wav_of(message) == wav


async def test_requests_sent_together_share_steps_and_each_gets_what_it_gets_alone(greedy: Served) -> None:
    http = greedy.http
    alone = []
    for prompt in PROMPTS:
        resp = await http.post("/v1/chat/completions", json=body(prompt))
        assert resp.status_code == 200, resp.text
        alone.append(resp.json()["choices"][0]["message"])
    before = (await http.get("/metrics")).text
    together = await asyncio.gather(*(http.post("/v1/chat/completions", json=body(p)) for p in PROMPTS))
    after = (await http.get("/metrics")).text
    for single, resp in zip(alone, together, strict=True):
        assert resp.status_code == 200, resp.text
        message = resp.json()["choices"][0]["message"]
        assert message["content"] == single["content"]
        assert wav_of(message) == wav_of(single)
    for stage in ("thinker", "talker"):
        assert batched_steps(after, stage) > batched_steps(before, stage), stage
