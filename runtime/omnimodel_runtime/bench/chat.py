"""Chat mode (``/v1/chat/completions``, text): overhead of the two HTTP hops against the engine called
directly, and throughput at concurrency N and 1 through the gateway and for the engine alone.

All requests are greedy with ``ignore_eos`` and a fixed ``max_tokens``, so both paths generate exactly
the same number of tokens.
"""

# Imports sit inside functions on purpose: each mode pulls in only what it needs.
# ruff: noqa: PLC0415

from __future__ import annotations

import argparse
import contextlib
import secrets
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Final

from omnimodel_runtime.bench.common import (
    GatewayClient,
    concurrently,
    device,
    latency_ratios,
    pct,
    run_sections,
)

PROMPTS: Final = (
    "Hello! Who are you?",
    "Write a short poem about a Kubernetes operator.",
    "Explain in one paragraph what a stage graph is.",
    "List three colours and three numbers.",
    "What is the capital of the cluster?",
    "Tell me a story about a tiny random model that learned to speak.",
    "Summarise the previous answer in five words.",
    "Why do engines batch requests?",
)


@dataclass
class Sample:
    latency: float
    ttft: float | None
    completion_tokens: int


def summary(samples: list[Sample], wall: float) -> dict[str, Any]:
    lat = [s.latency for s in samples]
    ttft = [s.ttft for s in samples if s.ttft is not None]
    tokens = sum(s.completion_tokens for s in samples)
    out: dict[str, Any] = {
        "requests": len(samples),
        "wall_s": round(wall, 4),
        "latency_p50_s": round(pct(lat, 50), 4),
        "latency_p99_s": round(pct(lat, 99), 4),
        "latency_mean_s": round(statistics.fmean(lat), 4) if lat else None,
        "completion_tokens": tokens,
        "tokens_per_s": round(tokens / wall, 2) if wall > 0 else None,
        "requests_per_s": round(len(samples) / wall, 3) if wall > 0 else None,
    }
    if ttft:
        out["ttft_p50_s"] = round(pct(ttft, 50), 4)
        out["ttft_p99_s"] = round(pct(ttft, 99), 4)
    return out


class ChatClient(GatewayClient):
    """Greedy chat requests with ``ignore_eos`` and a fixed ``max_tokens``: every run generates exactly
    as many tokens as the direct engine."""

    def __init__(self, url: str, api_key: str | None, max_tokens: int) -> None:
        super().__init__(url, api_key)
        self.max_tokens = max_tokens

    def _body(self, prompt: str, stream: bool) -> dict[str, Any]:
        return {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {}),
        }

    async def once(self, prompt: str) -> Sample:
        started = time.perf_counter()
        resp = await self._client.post("/v1/chat/completions", json=self._body(prompt, False))
        resp.raise_for_status()
        usage = resp.json()["usage"]
        return Sample(time.perf_counter() - started, None, int(usage["completion_tokens"]))

    async def streamed(self, prompt: str) -> Sample:
        started = time.perf_counter()
        ttft: float | None = None
        tokens = 0
        async for chunk in self.sse_chunks("/v1/chat/completions", self._body(prompt, True)):
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
            for choice in chunk.get("choices", []):
                if ttft is None and choice.get("delta", {}).get("content"):
                    ttft = time.perf_counter() - started
        return Sample(time.perf_counter() - started, ttft, tokens)


class Direct:
    """The same engine in this process, called without any HTTP or serialization."""

    def __init__(self, engine: Any, max_tokens: int) -> None:
        self.engine = engine
        self.max_tokens = max_tokens

    async def run(self, prompt: str, *, stream: bool = True) -> Sample:
        from omnimodel_runtime.protocol.stage import FinalFrame, SamplingParams, StageInput, StageRequest, TextFrame

        request = StageRequest(
            request_id=secrets.token_hex(8),
            messages=({"role": "user", "content": prompt},),
            sampling=SamplingParams(max_tokens=self.max_tokens, temperature=0.0, ignore_eos=True),
            stream=stream,
        )
        started = time.perf_counter()
        ttft: float | None = None
        tokens = 0
        async for frame in self.engine.generate(StageInput(request=request)):
            if isinstance(frame, TextFrame) and ttft is None and frame.text:
                ttft = time.perf_counter() - started
            if isinstance(frame, FinalFrame):
                tokens = frame.usage.completion_tokens
        return Sample(time.perf_counter() - started, ttft, tokens)


async def _overhead(direct: Direct, through_gateway: Any, stream: bool, rounds: int) -> dict[str, Any]:
    """Gateway + stage latency over direct engine latency, alternating the two on the same prompts."""
    d_lat, g_lat, ratios = [], [], []
    for _ in range(rounds):
        for prompt in PROMPTS:
            d = await direct.run(prompt, stream=stream)
            g = await through_gateway(prompt)
            if d.completion_tokens != g.completion_tokens:
                raise RuntimeError("direct and gateway runs generated different token counts")
            d_lat.append(d.latency)
            g_lat.append(g.latency)
            ratios.append(g.latency / d.latency)
    return {"streamed": stream, "pairs": len(ratios), **latency_ratios(d_lat, g_lat, ratios)}


@contextlib.asynccontextmanager
async def _direct_engine(args: argparse.Namespace) -> AsyncIterator[Any]:
    from omnimodel_runtime.bench import engine_args
    from omnimodel_runtime.engines.registry import load_engine
    from omnimodel_runtime.serve import serve_pipeline
    from omnimodel_runtime.settings import RuntimeSettings

    pipeline = serve_pipeline(
        args.preset, args.model, engines=[args.engine], engine_args=engine_args(args) or None, device=device()
    )
    settings = RuntimeSettings()
    engine = await load_engine(pipeline.entry, pipeline.model, settings)
    await engine.start()
    try:
        await engine.warmup()
        yield engine
    finally:
        await engine.stop()


async def measure(args: argparse.Namespace, url: str) -> dict[str, Any]:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
    gw = ChatClient(url, args.api_key, args.max_tokens)
    result: dict[str, Any] = {}
    try:
        gw.model = await gw.model_id()
        await gw.once(PROMPTS[0])  # connection set-up and any lazy work outside the numbers
        async with contextlib.AsyncExitStack() as stack:
            direct = None
            if not args.no_direct:
                direct = Direct(await stack.enter_async_context(_direct_engine(args)), args.max_tokens)

            seq_prompts = prompts[: max(args.concurrency, 8)]

            async def overhead() -> None:
                assert direct is not None
                result["overhead"] = await _overhead(direct, gw.once, False, args.rounds)
                result["overhead_streamed"] = await _overhead(direct, gw.streamed, True, args.rounds)

            async def throughput(name: str, fn: Callable[[str], Awaitable[Sample]]) -> None:
                samples, wall = await concurrently(fn, prompts, args.concurrency)
                result[f"{name}_concurrent"] = {"concurrency": args.concurrency, **summary(samples, wall)}
                samples, wall = await concurrently(fn, seq_prompts, 1)
                result[f"{name}_sequential"] = {"concurrency": 1, **summary(samples, wall)}
                result[f"{name}_batching_factor"] = round(
                    result[f"{name}_concurrent"]["tokens_per_s"] / result[f"{name}_sequential"]["tokens_per_s"], 3
                )

            # 1. overhead: sequential, interleaved, same prompts, non-streamed and streamed requests;
            # 2. throughput through the gateway at concurrency N (streamed, for TTFT) and at 1;
            # 3. the engine alone at N and at 1 (its batching factor).
            # A failing section is recorded and the others still run: one run's numbers are costly.
            sections: list[tuple[str, Callable[[], Awaitable[None]]]] = [
                ("gateway_throughput", partial(throughput, "gateway", gw.streamed))
            ]
            if direct is not None:
                direct_throughput = partial(throughput, "direct", direct.run)
                sections = [("overhead", overhead), *sections, ("direct_throughput", direct_throughput)]
            await run_sections(sections, result)
    finally:
        await gw.aclose()
    return result
