"""Speech mode (``/v1/audio/speech``): time to first audio and real-time factor, streamed at concurrency
1 and N and whole, and the overhead of the gateway and stage processes against the same stages called in
this process."""

# Imports sit inside functions on purpose: each mode pulls in only what it needs.
# ruff: noqa: PLC0415

from __future__ import annotations

import argparse
import contextlib
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Final

from omnimodel_runtime.bench.common import GatewayClient, concurrently, device, pct, run_sections

SPEECH_TEXTS: Final = (
    "Hello! This is the speech pipeline speaking.",
    "A Kubernetes operator turns one custom resource into a deployment per stage.",
    "The acoustic stage decodes mel frames; the vocoder turns them into sound.",
    "Streaming starts the vocoder on the first chunk, long before the sentence ends.",
    "Seven silver swans swam silently seaward.",
    "Time to first audio and the real-time factor are what a listener notices.",
    "One, two, three, four, five, six, seven, eight, nine, ten.",
    "The quick brown fox jumps over the lazy dog, twice.",
)


def selected(args: argparse.Namespace) -> bool:
    from omnimodel_runtime.pipeline import Route, get_preset

    if args.mode != "auto":
        return bool(args.mode == "speech")
    routes = get_preset(args.preset).routes
    return Route.SPEECH in routes and Route.CHAT not in routes


@dataclass
class SpeechSample:
    latency: float
    ttfa: float | None  # time to the first audio byte (streamed requests)
    audio_s: float


def summary(samples: list[SpeechSample], wall: float) -> dict[str, Any]:
    lat = [s.latency for s in samples]
    ttfa = [s.ttfa for s in samples if s.ttfa is not None]
    rtf = [s.latency / s.audio_s for s in samples if s.audio_s > 0]
    audio = sum(s.audio_s for s in samples)
    out: dict[str, Any] = {
        "requests": len(samples),
        "wall_s": round(wall, 4),
        "audio_s": round(audio, 3),
        "latency_p50_s": round(pct(lat, 50), 4),
        "latency_p99_s": round(pct(lat, 99), 4),
        # Per request: synthesis time / duration of the audio (< 1 is faster than real time).
        "rtf_p50": round(pct(rtf, 50), 4),
        "rtf_p99": round(pct(rtf, 99), 4),
        # The whole run: wall time / all audio produced (the server's capacity at this concurrency).
        "rtf_aggregate": round(wall / audio, 4) if audio > 0 else None,
    }
    if ttfa:
        out["ttfa_p50_s"] = round(pct(ttfa, 50), 4)
        out["ttfa_p99_s"] = round(pct(ttfa, 99), 4)
    return out


class SpeechClient(GatewayClient):
    """``/v1/audio/speech`` requests: streamed raw PCM, or a whole file."""

    async def streamed(self, text: str) -> SpeechSample:
        body = {"model": self.model, "input": text, "stream": True}
        started = time.perf_counter()
        ttfa: float | None = None
        size = 0
        async with self._client.stream("POST", "/v1/audio/speech", json=body) as resp:
            resp.raise_for_status()
            rate = int(resp.headers["x-sample-rate"])
            async for chunk in resp.aiter_raw():
                if ttfa is None and chunk:
                    ttfa = time.perf_counter() - started
                size += len(chunk)
        return SpeechSample(time.perf_counter() - started, ttfa, size / 2 / rate)

    async def whole(self, text: str) -> SpeechSample:
        body = {"model": self.model, "input": text, "response_format": "pcm"}
        started = time.perf_counter()
        resp = await self._client.post("/v1/audio/speech", json=body)
        resp.raise_for_status()
        rate = int(resp.headers["x-sample-rate"])
        return SpeechSample(time.perf_counter() - started, None, len(resp.content) / 2 / rate)


@contextlib.asynccontextmanager
async def _speech_direct(args: argparse.Namespace) -> AsyncIterator[Any]:
    """Every stage in this process behind the orchestrator (no HTTP, no serialization): the baseline."""
    from prometheus_client import CollectorRegistry

    from omnimodel_runtime.engines.registry import load_engine
    from omnimodel_runtime.metrics import StageMetricsFamily
    from omnimodel_runtime.serve import serve_pipeline
    from omnimodel_runtime.serving.orchestrator import Orchestrator
    from omnimodel_runtime.settings import RuntimeSettings
    from omnimodel_runtime.stage.handle import StageHandle
    from omnimodel_runtime.stage.local import LocalStage

    pipeline = serve_pipeline(args.preset, args.model, engines=[args.engine], device=device())
    settings = RuntimeSettings()
    family = StageMetricsFamily(CollectorRegistry())
    handles: dict[str, StageHandle] = {}
    try:
        for stage in pipeline.stages:
            engine = await load_engine(stage, pipeline.model, settings)
            handles[stage.name] = LocalStage(stage, engine, family.for_stage(stage.name))
            await handles[stage.name].start()
        yield Orchestrator(pipeline, handles)
    finally:
        for handle in handles.values():
            await handle.stop()


async def _direct_speech(orchestrator: Any, text: str) -> SpeechSample:
    from omnimodel_runtime.pipeline import Modality
    from omnimodel_runtime.protocol.stage import StageParams, StageRequest, TensorFrame

    # As the speech route asks: a chat model at the entry (the omni thinker) must speak, not answer.
    speak = Modality.TEXT in orchestrator.pipeline.entry.outputs
    request = StageRequest(request_id=secrets.token_hex(8), prompt=text, stream=False, params=StageParams(speak=speak))
    started = time.perf_counter()
    samples, rate = 0, 1
    async for _, frame in orchestrator.generate_chain(request, [Modality.AUDIO]):
        if isinstance(frame, TensorFrame) and "audio" in frame.tensors:
            samples += len(frame.tensors["audio"])
            rate = int(frame.meta["sample_rate"])
    return SpeechSample(time.perf_counter() - started, None, samples / rate)


async def measure(args: argparse.Namespace, url: str) -> dict[str, Any]:
    texts = [SPEECH_TEXTS[i % len(SPEECH_TEXTS)] for i in range(args.requests)]
    client = SpeechClient(url, args.api_key)
    result: dict[str, Any] = {}
    try:
        client.model = await client.model_id()
        await client.whole(SPEECH_TEXTS[0])  # connection set-up and any lazy work outside the numbers

        async def streamed() -> None:
            # Time to first audio and real-time factor, streamed, at concurrency 1 and N.
            for concurrency in sorted({1, args.concurrency}):
                samples, wall = await concurrently(client.streamed, texts, concurrency)
                result[f"streamed_c{concurrency}"] = {"concurrency": concurrency, **summary(samples, wall)}

        async def whole() -> None:
            samples, wall = await concurrently(client.whole, texts[: len(SPEECH_TEXTS)], 1)
            result["whole_c1"] = {"concurrency": 1, **summary(samples, wall)}

        async def overhead() -> None:
            # Gateway + two stage processes against the same stages in this process, interleaved.
            async with _speech_direct(args) as orchestrator:
                await _direct_speech(orchestrator, SPEECH_TEXTS[0])
                direct, gateway = [], []
                for _ in range(args.rounds):
                    for text in SPEECH_TEXTS:
                        direct.append((await _direct_speech(orchestrator, text)).latency)
                        gateway.append((await client.whole(text)).latency)
            result["overhead"] = {
                "pairs": len(direct),
                "direct_latency_p50_s": round(pct(direct, 50), 4),
                "gateway_latency_p50_s": round(pct(gateway, 50), 4),
                "ratio_of_medians": round(pct(gateway, 50) / pct(direct, 50), 4),
                "ratio_p50": round(pct([g / d for g, d in zip(gateway, direct, strict=True)], 50), 4),
            }

        sections = [("streamed", streamed), ("whole", whole)]
        if not args.no_direct:
            sections.append(("overhead", overhead))
        await run_sections(sections, result)
    finally:
        await client.aclose()
    return result
