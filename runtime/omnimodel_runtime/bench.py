"""``omnimodel bench``: latency, TTFT and throughput through gateway + stage, against the engine called
directly on the same prompts in the same run.

Without ``--url`` it deploys the preset itself as separate processes (``omnimodel stage`` and
``omnimodel gateway`` from one pipeline file, on loopback ports), so every measured request crosses both
HTTP hops exactly as in a cluster. The direct baseline loads the same engine in this process. Overhead
is measured sequentially and interleaved (direct, gateway, direct, ...) so both see the same machine
state; throughput is measured at concurrency N and at 1 through the gateway, and the same for the
direct engine (its ratio is the engine's batching factor).

All requests are greedy with ``ignore_eos`` and a fixed ``max_tokens``, so both paths generate exactly
the same number of tokens.
"""

# Imports sit inside functions on purpose: each command pulls in only what it needs.
# ruff: noqa: PLC0415

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, cast

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


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``omnimodel bench`` (kept here so the CLI module stays small)."""
    p.add_argument("--url", default=None, help="gateway to drive (default: deploy stage + gateway locally)")
    p.add_argument("--preset", default="text")
    p.add_argument("--model", default="tiny://text")
    p.add_argument("--engine", default="transformers", choices=["transformers", "vllm", "diffusers"])
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests", type=int, default=32, help="requests per concurrency run")
    p.add_argument("--rounds", type=int, default=3, help="sequential interleaved rounds over the prompts")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--api-key", default=None)
    p.add_argument("--no-direct", action="store_true", help="skip the in-process engine baseline")
    p.add_argument("--out", type=Path, default=None, help="write the JSON here (default: stdout only)")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument(
        "--mode",
        default="auto",
        choices=["auto", "chat", "speech", "omni", "images"],
        help=(
            "what to measure (auto: images for presets serving /v1/images/generations, speech for presets "
            "serving /v1/audio/speech only, omni for chat presets with audio output, else chat)"
        ),
    )
    images = p.add_argument_group("images mode")
    images.add_argument("--size", default="512x512", help="image size WIDTHxHEIGHT")
    images.add_argument("--steps", type=int, default=20, help="denoising steps")
    images.add_argument("--negative-prompt", default=None, help="turns classifier-free guidance on")
    images.add_argument("--true-cfg-scale", type=float, default=4.0, help="guidance scale with --negative-prompt")
    images.add_argument(
        "--image-concurrency",
        type=lambda v: sorted({int(c) for c in v.split(",")}),
        default=[1, 4, 8],
        help="comma-separated concurrency levels (default 1,4,8)",
    )
    images.add_argument(
        "--image-requests", type=int, default=8, help="requests per concurrency level (at least 2 per client)"
    )
    images.add_argument("--overhead-prompts", type=int, default=4, help="prompts per overhead round")


@dataclass
class Sample:
    latency: float
    ttft: float | None
    completion_tokens: int


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def _summary(samples: list[Sample], wall: float) -> dict[str, Any]:
    lat = [s.latency for s in samples]
    ttft = [s.ttft for s in samples if s.ttft is not None]
    tokens = sum(s.completion_tokens for s in samples)
    out: dict[str, Any] = {
        "requests": len(samples),
        "wall_s": round(wall, 4),
        "latency_p50_s": round(_pct(lat, 50), 4),
        "latency_p99_s": round(_pct(lat, 99), 4),
        "latency_mean_s": round(statistics.fmean(lat), 4) if lat else None,
        "completion_tokens": tokens,
        "tokens_per_s": round(tokens / wall, 2) if wall > 0 else None,
        "requests_per_s": round(len(samples) / wall, 3) if wall > 0 else None,
    }
    if ttft:
        out["ttft_p50_s"] = round(_pct(ttft, 50), 4)
        out["ttft_p99_s"] = round(_pct(ttft, 99), 4)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class _GatewayClient:
    def __init__(self, url: str, model: str, api_key: str | None, max_tokens: int) -> None:
        import httpx

        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(base_url=url, headers=headers, timeout=600)
        self.model = model
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
        async with self._client.stream("POST", "/v1/chat/completions", json=self._body(prompt, True)) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"]["message"])
                if chunk.get("usage"):
                    tokens = int(chunk["usage"]["completion_tokens"])
                for choice in chunk.get("choices", []):
                    if ttft is None and choice.get("delta", {}).get("content"):
                        ttft = time.perf_counter() - started
        return Sample(time.perf_counter() - started, ttft, tokens)

    async def model_id(self) -> str:
        resp = await self._client.get("/v1/models")
        resp.raise_for_status()
        model: str = resp.json()["data"][0]["id"]
        return model

    async def aclose(self) -> None:
        await self._client.aclose()


class _Direct:
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


async def _overhead(direct: _Direct, through_gateway: Any, stream: bool, rounds: int) -> dict[str, Any]:
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
    return {
        "streamed": stream,
        "pairs": len(ratios),
        "direct_latency_p50_s": round(_pct(d_lat, 50), 4),
        "gateway_latency_p50_s": round(_pct(g_lat, 50), 4),
        "ratio_of_medians": round(_pct(g_lat, 50) / _pct(d_lat, 50), 4),
        "ratio_p50": round(_pct(ratios, 50), 4),
        "ratio_p99": round(_pct(ratios, 99), 4),
        "added_latency_p50_ms": round((_pct(g_lat, 50) - _pct(d_lat, 50)) * 1000, 2),
    }


async def _concurrent(fn: Any, prompts: list[str], concurrency: int) -> tuple[list[Sample], float]:
    queue: asyncio.Queue[str] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    samples: list[Sample] = []

    async def worker() -> None:
        while True:
            try:
                prompt = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            samples.append(await fn(prompt))

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return samples, time.perf_counter() - started


def _device() -> str:
    from omnimodel_runtime.engines.devices import resolve_device
    from omnimodel_runtime.settings import RuntimeSettings

    return resolve_device(RuntimeSettings().device)


@contextlib.contextmanager
def _deployment(args: argparse.Namespace, workdir: Path) -> Iterator[str]:
    """Start ``omnimodel stage`` + ``omnimodel gateway`` from one pipeline file; yield the gateway URL."""
    from omnimodel_runtime.serve import serve_pipeline

    stage_port, gateway_port = _free_port(), _free_port()
    base = serve_pipeline(args.preset, args.model, engines=[args.engine], device=_device())
    stages = [s.model_copy(update={"endpoints": (f"http://127.0.0.1:{stage_port}",)}) for s in base.stages]
    if len(stages) != 1:
        raise SystemExit("bench deploys single-stage presets only (pass --url for others)")
    pipeline = base.model_copy(update={"stages": tuple(stages)})
    path = workdir / "pipeline.json"
    path.write_text(pipeline.to_json())
    env = {**os.environ, "OMNIMODEL_LOG_LEVEL": "warning"}
    cmd = [sys.executable, "-m", "omnimodel_runtime"]
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    try:
        for name, extra in (
            ("stage", ["stage", "--pipeline", str(path), "--stage", stages[0].name, "--port", str(stage_port)]),
            ("gateway", ["gateway", "--pipeline", str(path), "--port", str(gateway_port)]),
        ):
            log = (workdir / f"{name}.log").open("wb")
            logs.append(log)
            procs.append(subprocess.Popen([*cmd, *extra], stdout=log, stderr=subprocess.STDOUT, env=env))
        url = f"http://127.0.0.1:{gateway_port}"
        _wait_healthy(url, procs, workdir, args.start_timeout)
        yield url
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()


def _wait_healthy(url: str, procs: list[subprocess.Popen[bytes]], workdir: Path, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                tails = "\n".join(p.read_text()[-2000:] for p in sorted(workdir.glob("*.log")))
                raise SystemExit(f"a benchmark process exited with {proc.returncode}:\n{tails}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise SystemExit(f"gateway {url} did not become healthy within {timeout:.0f} s")


@contextlib.asynccontextmanager
async def _direct_engine(args: argparse.Namespace) -> AsyncIterator[Any]:
    from omnimodel_runtime.engines.registry import load_engine
    from omnimodel_runtime.serve import serve_pipeline
    from omnimodel_runtime.settings import RuntimeSettings

    pipeline = serve_pipeline(args.preset, args.model, engines=[args.engine], device=_device())
    settings = RuntimeSettings()
    engine = await load_engine(pipeline.entry, pipeline.model, settings)
    await engine.start()
    try:
        await engine.warmup()
        yield engine
    finally:
        await engine.stop()


async def _measure(args: argparse.Namespace, url: str) -> dict[str, Any]:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
    gw = _GatewayClient(url, "", args.api_key, args.max_tokens)
    result: dict[str, Any] = {}
    try:
        gw.model = await gw.model_id()
        await gw.once(PROMPTS[0])  # connection set-up and any lazy work outside the numbers
        async with contextlib.AsyncExitStack() as stack:
            direct = None
            if not args.no_direct:
                direct = _Direct(await stack.enter_async_context(_direct_engine(args)), args.max_tokens)

            seq_prompts = prompts[: max(args.concurrency, 8)]

            async def overhead() -> None:
                assert direct is not None
                result["overhead"] = await _overhead(direct, gw.once, False, args.rounds)
                result["overhead_streamed"] = await _overhead(direct, gw.streamed, True, args.rounds)

            async def gateway_throughput() -> None:
                samples, wall = await _concurrent(gw.streamed, prompts, args.concurrency)
                result["gateway_concurrent"] = {"concurrency": args.concurrency, **_summary(samples, wall)}
                samples, wall = await _concurrent(gw.streamed, seq_prompts, 1)
                result["gateway_sequential"] = {"concurrency": 1, **_summary(samples, wall)}
                result["gateway_batching_factor"] = round(
                    result["gateway_concurrent"]["tokens_per_s"] / result["gateway_sequential"]["tokens_per_s"], 3
                )

            async def direct_throughput() -> None:
                assert direct is not None
                samples, wall = await _concurrent(direct.run, prompts, args.concurrency)
                result["direct_concurrent"] = {"concurrency": args.concurrency, **_summary(samples, wall)}
                samples, wall = await _concurrent(direct.run, seq_prompts, 1)
                result["direct_sequential"] = {"concurrency": 1, **_summary(samples, wall)}
                result["direct_batching_factor"] = round(
                    result["direct_concurrent"]["tokens_per_s"] / result["direct_sequential"]["tokens_per_s"], 3
                )

            # 1. overhead: sequential, interleaved, same prompts, non-streamed and streamed requests;
            # 2. throughput through the gateway at concurrency N (streamed, for TTFT) and at 1;
            # 3. the engine alone at N and at 1 (its batching factor).
            # A failing section is recorded and the others still run: one run's numbers are costly.
            sections = [("gateway_throughput", gateway_throughput)]
            if direct is not None:
                sections = [("overhead", overhead), *sections, ("direct_throughput", direct_throughput)]
            for name, section in sections:
                try:
                    await section()
                except Exception as err:
                    result.setdefault("errors", {})[name] = f"{type(err).__name__}: {err}"
    finally:
        await gw.aclose()
    return result


def _accelerator_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args``; print the JSON and write it to ``--out``."""
    from importlib.metadata import version

    meta: dict[str, Any] = {
        "command": "omnimodel bench " + " ".join(sys.argv[2:]) if len(sys.argv) > 1 else "omnimodel bench",
        "preset": args.preset,
        "model": args.model,
        "engine": args.engine,
        "max_tokens": args.max_tokens,
        "concurrency": args.concurrency,
        "requests": args.requests,
        "rounds": args.rounds,
        "topology": "external gateway" if args.url else "gateway process -> stage process (loopback HTTP)",
        "host": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": version("torch"),
            "accelerator": _accelerator_name(),
            "platform": platform.platform(),
        },
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    images = _images_mode(args)
    speech = not images and _speech_mode(args)
    omni = not images and _omni_mode(args)
    if images:
        width, height = _image_size(args)
        for key in ("max_tokens", "concurrency", "requests"):
            meta.pop(key)
        meta.update(
            mode="images",
            engine="diffusers",
            size=f"{width}x{height}",
            steps=args.steps,
            negative_prompt=args.negative_prompt,
            true_cfg_scale=args.true_cfg_scale if args.negative_prompt is not None else None,
            image_concurrency=args.image_concurrency,
            image_requests=args.image_requests,
            topology="gateway process -> one process per stage (loopback HTTP)",
        )
    if omni:
        meta.update(mode="omni", topology="omnimodel serve (one process) vs gateway + one process per stage")
    if speech:
        meta.update(mode="speech", topology="gateway process -> one process per stage (loopback HTTP)")
        meta.pop("max_tokens")
    with tempfile.TemporaryDirectory(prefix="omnimodel-bench-") as tmp, contextlib.ExitStack() as stack:
        if images:
            args.engine = "diffusers"
            url = args.url or stack.enter_context(_speech_deployment(args, Path(tmp)))
            results = asyncio.run(_measure_images(args, url))
        elif omni:
            # Both deployments side by side in one run, measured interleaved on the same prompts.
            urls = {
                "in_process": stack.enter_context(_omni_serve(args, Path(tmp))),
                "three_processes": stack.enter_context(_speech_deployment(args, Path(tmp))),
            }
            results = asyncio.run(_measure_omni(args, urls))
        elif speech:
            url = args.url or stack.enter_context(_speech_deployment(args, Path(tmp)))
            results = asyncio.run(_measure_speech(args, url))
        else:
            url = args.url or stack.enter_context(_deployment(args, Path(tmp)))
            results = asyncio.run(_measure(args, url))
    report = {"meta": meta, "results": results}
    text = json.dumps(report, indent=2) + "\n"
    print(text, end="")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


# ---------------------------------------------------------------- speech mode (/v1/audio/speech)

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


def _speech_mode(args: argparse.Namespace) -> bool:
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


def _speech_summary(samples: list[SpeechSample], wall: float) -> dict[str, Any]:
    lat = [s.latency for s in samples]
    ttfa = [s.ttfa for s in samples if s.ttfa is not None]
    rtf = [s.latency / s.audio_s for s in samples if s.audio_s > 0]
    audio = sum(s.audio_s for s in samples)
    out: dict[str, Any] = {
        "requests": len(samples),
        "wall_s": round(wall, 4),
        "audio_s": round(audio, 3),
        "latency_p50_s": round(_pct(lat, 50), 4),
        "latency_p99_s": round(_pct(lat, 99), 4),
        # Per request: synthesis time / duration of the audio (< 1 is faster than real time).
        "rtf_p50": round(_pct(rtf, 50), 4),
        "rtf_p99": round(_pct(rtf, 99), 4),
        # The whole run: wall time / all audio produced (the server's capacity at this concurrency).
        "rtf_aggregate": round(wall / audio, 4) if audio > 0 else None,
    }
    if ttfa:
        out["ttfa_p50_s"] = round(_pct(ttfa, 50), 4)
        out["ttfa_p99_s"] = round(_pct(ttfa, 99), 4)
    return out


class _SpeechClient:
    def __init__(self, url: str, api_key: str | None) -> None:
        import httpx

        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(base_url=url, headers=headers, timeout=600)
        self.model = ""

    async def model_id(self) -> str:
        resp = await self._client.get("/v1/models")
        resp.raise_for_status()
        model: str = resp.json()["data"][0]["id"]
        return model

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

    async def aclose(self) -> None:
        await self._client.aclose()


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

    pipeline = serve_pipeline(args.preset, args.model, engines=[args.engine], device=_device())
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


async def _measure_speech(args: argparse.Namespace, url: str) -> dict[str, Any]:
    texts = [SPEECH_TEXTS[i % len(SPEECH_TEXTS)] for i in range(args.requests)]
    client = _SpeechClient(url, args.api_key)
    result: dict[str, Any] = {}
    try:
        client.model = await client.model_id()
        await client.whole(SPEECH_TEXTS[0])  # connection set-up and any lazy work outside the numbers

        async def streamed() -> None:
            # Time to first audio and real-time factor, streamed, at concurrency 1 and N.
            for concurrency in sorted({1, args.concurrency}):
                samples, wall = await _concurrent(client.streamed, texts, concurrency)
                summary = _speech_summary(cast("list[SpeechSample]", samples), wall)
                result[f"streamed_c{concurrency}"] = {"concurrency": concurrency, **summary}

        async def whole() -> None:
            samples, wall = await _concurrent(client.whole, texts[: len(SPEECH_TEXTS)], 1)
            result["whole_c1"] = {"concurrency": 1, **_speech_summary(cast("list[SpeechSample]", samples), wall)}

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
                "direct_latency_p50_s": round(_pct(direct, 50), 4),
                "gateway_latency_p50_s": round(_pct(gateway, 50), 4),
                "ratio_of_medians": round(_pct(gateway, 50) / _pct(direct, 50), 4),
                "ratio_p50": round(_pct([g / d for g, d in zip(gateway, direct, strict=True)], 50), 4),
            }

        sections = [("streamed", streamed), ("whole", whole)]
        if not args.no_direct:
            sections.append(("overhead", overhead))
        for name, section in sections:
            try:
                await section()
            except Exception as err:
                result.setdefault("errors", {})[name] = f"{type(err).__name__}: {err}"
    finally:
        await client.aclose()
    return result


@contextlib.contextmanager
def _speech_deployment(args: argparse.Namespace, workdir: Path) -> Iterator[str]:
    """One ``omnimodel stage`` process per stage and an ``omnimodel gateway``; yield the gateway URL."""
    from omnimodel_runtime.serve import serve_pipeline

    base = serve_pipeline(args.preset, args.model, engines=[args.engine], device=_device())
    ports = {s.name: _free_port() for s in base.stages}
    stages = tuple(s.model_copy(update={"endpoints": (f"http://127.0.0.1:{ports[s.name]}",)}) for s in base.stages)
    path = workdir / "pipeline.json"
    path.write_text(base.model_copy(update={"stages": stages}).to_json())
    env = {**os.environ, "OMNIMODEL_LOG_LEVEL": "warning"}
    cmd = [sys.executable, "-m", "omnimodel_runtime"]
    gateway_port = _free_port()
    commands = [
        (name, ["stage", "--pipeline", str(path), "--stage", name, "--port", str(port)]) for name, port in ports.items()
    ]
    commands.append(("gateway", ["gateway", "--pipeline", str(path), "--port", str(gateway_port)]))
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    try:
        for name, extra in commands:
            log = (workdir / f"{name}.log").open("wb")
            logs.append(log)
            procs.append(subprocess.Popen([*cmd, *extra], stdout=log, stderr=subprocess.STDOUT, env=env))
        url = f"http://127.0.0.1:{gateway_port}"
        _wait_healthy(url, procs, workdir, args.start_timeout)
        yield url
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()


# ---------------------------------------------------------------- omni mode (chat with text and audio out)


def _omni_mode(args: argparse.Namespace) -> bool:
    from omnimodel_runtime.pipeline import Modality, Route, get_preset

    if args.mode != "auto":
        return bool(args.mode == "omni")
    preset = get_preset(args.preset)
    return Route.CHAT in preset.routes and Modality.AUDIO in preset.modalities


@dataclass
class OmniSample:
    latency: float
    ttft: float | None  # first text delta
    ttfa: float | None  # first audio chunk (streamed) — the number a listener notices
    text_done: float | None  # last text delta
    audio_s: float

    @property
    def rtf(self) -> float | None:
        return self.latency / self.audio_s if self.audio_s > 0 else None


class _OmniClient:
    def __init__(self, url: str, api_key: str | None, max_tokens: int) -> None:
        import httpx

        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(base_url=url, headers=headers, timeout=600)
        self.max_tokens = max_tokens
        self.model = ""

    def _body(self, prompt: str, stream: bool) -> dict[str, Any]:
        return {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "modalities": ["text", "audio"],
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "seed": 0,
            "stream": stream,
        }

    async def streamed(self, prompt: str) -> OmniSample:
        import base64

        started = time.perf_counter()
        ttft = ttfa = text_done = None
        pcm_bytes = 0
        async with self._client.stream("POST", "/v1/chat/completions", json=self._body(prompt, True)) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"]["message"])
                now = time.perf_counter() - started
                for choice in chunk.get("choices", []):
                    delta = choice.get("delta", {})
                    if delta.get("content"):
                        ttft = now if ttft is None else ttft
                        text_done = now
                    data = (delta.get("audio") or {}).get("data")
                    if data:
                        ttfa = now if ttfa is None else ttfa
                        pcm_bytes += len(base64.b64decode(data))
        return OmniSample(time.perf_counter() - started, ttft, ttfa, text_done, pcm_bytes / 2 / 24000)

    async def whole(self, prompt: str) -> OmniSample:
        import base64
        import io
        import wave

        started = time.perf_counter()
        resp = await self._client.post("/v1/chat/completions", json=self._body(prompt, False))
        resp.raise_for_status()
        audio = resp.json()["choices"][0]["message"]["audio"]
        with wave.open(io.BytesIO(base64.b64decode(audio["data"]))) as w:
            seconds = w.getnframes() / w.getframerate()
        return OmniSample(time.perf_counter() - started, None, None, None, seconds)

    async def model_id(self) -> str:
        resp = await self._client.get("/v1/models")
        resp.raise_for_status()
        model: str = resp.json()["data"][0]["id"]
        return model

    async def aclose(self) -> None:
        await self._client.aclose()


def _omni_summary(samples: list[OmniSample]) -> dict[str, Any]:
    def pct(values: list[float | None], q: float) -> float | None:
        present = [v for v in values if v is not None]
        return round(_pct(present, q), 4) if present else None

    out: dict[str, Any] = {
        "requests": len(samples),
        "audio_s_mean": round(statistics.fmean(s.audio_s for s in samples), 3) if samples else None,
        "latency_p50_s": pct([s.latency for s in samples], 50),
        "latency_p99_s": pct([s.latency for s in samples], 99),
        # Synthesis time / duration of the audio (< 1: faster than real time).
        "rtf_p50": pct([s.rtf for s in samples], 50),
        "rtf_p99": pct([s.rtf for s in samples], 99),
    }
    if any(s.ttfa is not None for s in samples):
        out.update(
            ttft_p50_s=pct([s.ttft for s in samples], 50),
            ttfa_p50_s=pct([s.ttfa for s in samples], 50),
            ttfa_p99_s=pct([s.ttfa for s in samples], 99),
            text_done_p50_s=pct([s.text_done for s in samples], 50),
            # How often the first audio reached the client before the last text delta.
            audio_before_text_end=sum(
                1 for s in samples if s.ttfa is not None and s.text_done is not None and s.ttfa < s.text_done
            ),
        )
    return out


async def _measure_omni(args: argparse.Namespace, urls: dict[str, str]) -> dict[str, Any]:
    clients = {name: _OmniClient(url, args.api_key, args.max_tokens) for name, url in urls.items()}
    result: dict[str, Any] = {}
    try:
        for client in clients.values():
            client.model = await client.model_id()
            await client.whole(PROMPTS[0])  # connection set-up and lazy work outside the numbers
        for kind in ("streamed", "whole"):
            samples: dict[str, list[OmniSample]] = {name: [] for name in clients}
            try:
                # Interleaved (in-process, three processes, in-process, ...) so both see the same machine.
                for _ in range(args.rounds):
                    for prompt in PROMPTS:
                        for name, client in clients.items():
                            samples[name].append(await getattr(client, kind)(prompt))
            except Exception as err:
                result.setdefault("errors", {})[kind] = f"{type(err).__name__}: {err}"
                continue
            section = {name: _omni_summary(found) for name, found in samples.items()}
            base, split = section["in_process"], section["three_processes"]
            section["latency_ratio_of_medians"] = round(split["latency_p50_s"] / base["latency_p50_s"], 4)
            if kind == "streamed":
                section["ttfa_ratio_of_medians"] = round(split["ttfa_p50_s"] / base["ttfa_p50_s"], 4)
            result[kind] = section
    finally:
        for client in clients.values():
            await client.aclose()
    return result


@contextlib.contextmanager
def _omni_serve(args: argparse.Namespace, workdir: Path) -> Iterator[str]:
    """``omnimodel serve``: the gateway and every stage in one process (in-memory hand-off)."""
    port = _free_port()
    env = {**os.environ, "OMNIMODEL_LOG_LEVEL": "warning"}
    cmd = [sys.executable, "-m", "omnimodel_runtime", "serve", "--preset", args.preset, "--model", args.model]
    cmd += ["--engine", args.engine, "--port", str(port)]
    with (workdir / "serve.log").open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_healthy(url, [proc], workdir, args.start_timeout)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# ---------------------------------------------------------------- images mode (/v1/images/generations)

IMAGE_PROMPTS: Final = (
    "a red fox in the snow",
    "a watercolor painting of a lighthouse on a rocky coast at sunset, with seagulls and a small boat",
    "an astronaut riding a horse",
    "a wooden cabin in a pine forest under a starry night sky",
    "a bowl of ramen",
    "a robot holding a sign that says hello world, photo, shallow depth of field",
    "an old castle on a mountain",
    "a glass of orange juice on a table next to a stack of books and a small green plant",
)


def _images_mode(args: argparse.Namespace) -> bool:
    from omnimodel_runtime.pipeline import Route, get_preset

    if args.mode != "auto":
        return bool(args.mode == "images")
    return Route.IMAGES in get_preset(args.preset).routes


def _image_size(args: argparse.Namespace) -> tuple[int, int]:
    from omnimodel_runtime.protocol.images import parse_size

    return parse_size(args.size)


def _image_params(args: argparse.Namespace) -> dict[str, Any]:
    """Diffusion parameters both paths use (classifier-free guidance only with a negative prompt)."""
    width, height = _image_size(args)
    params: dict[str, Any] = {"width": width, "height": height, "num_inference_steps": args.steps}
    if args.negative_prompt is not None:
        params["negative_prompt"] = args.negative_prompt
        params["true_cfg_scale"] = args.true_cfg_scale
    return params


@dataclass
class ImageSample:
    latency: float
    image: Any  # the first image's pixels (uint8 HxWx3), for the pixel comparisons


class _ImagesClient:
    def __init__(self, url: str, api_key: str | None, params: dict[str, Any]) -> None:
        import httpx

        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(base_url=url, headers=headers, timeout=600)
        self.model = ""
        self.params = params

    async def generate(self, prompt: str, seed: int) -> ImageSample:
        p = self.params
        body = {
            "model": self.model,
            "prompt": prompt,
            "size": f"{p['width']}x{p['height']}",
            "seed": seed,
            **{k: v for k, v in p.items() if k not in ("width", "height")},
        }
        started = time.perf_counter()
        resp = await self._client.post("/v1/images/generations", json=body)
        resp.raise_for_status()
        latency = time.perf_counter() - started
        return ImageSample(latency, resp.json()["data"][0]["b64_json"])

    async def model_id(self) -> str:
        resp = await self._client.get("/v1/models")
        resp.raise_for_status()
        model: str = resp.json()["data"][0]["id"]
        return model

    async def aclose(self) -> None:
        await self._client.aclose()


def _png_pixels(b64: str) -> Any:
    import base64
    import io

    import numpy as np
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))))


class _DirectDiffusers:
    """The diffusers pipeline itself in this process: ``pipe(prompt, ...)``, PIL images out."""

    def __init__(self, args: argparse.Namespace, params: dict[str, Any]) -> None:
        import torch
        from diffusers import DiffusionPipeline

        from omnimodel_runtime.models import resolve_model_dir
        from omnimodel_runtime.pipeline import ModelSource
        from omnimodel_runtime.settings import RuntimeSettings

        self.device = _device()
        model_dir = resolve_model_dir(ModelSource(source=args.model), RuntimeSettings())
        dtype = torch.float32 if self.device == "cpu" else torch.bfloat16
        self.pipe = DiffusionPipeline.from_pretrained(model_dir, dtype=dtype).to(self.device)
        self.pipe.set_progress_bar_config(disable=True)
        self.params = params

    def _call(self, prompts: list[str], seeds: list[int]) -> list[Any]:
        import numpy as np
        import torch

        p = self.params
        kwargs = {"negative_prompt": [p["negative_prompt"]] * len(prompts)} if "negative_prompt" in p else {}
        images = self.pipe(
            prompts,
            width=p["width"],
            height=p["height"],
            num_inference_steps=p["num_inference_steps"],
            true_cfg_scale=p.get("true_cfg_scale", 1.0),
            generator=[torch.Generator("cpu").manual_seed(s) for s in seeds],
            **kwargs,
        ).images
        return [np.asarray(image) for image in images]

    def run(self, prompt: str, seed: int) -> ImageSample:
        started = time.perf_counter()
        (image,) = self._call([prompt], [seed])
        return ImageSample(time.perf_counter() - started, image)

    def run_batch(self, prompts: list[str], seeds: list[int]) -> float:
        started = time.perf_counter()
        self._call(prompts, seeds)
        return time.perf_counter() - started


def _image_summary(samples: list[ImageSample], wall: float, concurrency: int) -> dict[str, Any]:
    lat = [s.latency for s in samples]
    return {
        "concurrency": concurrency,
        "requests": len(samples),
        "wall_s": round(wall, 3),
        "images_per_s": round(len(samples) / wall, 4) if wall > 0 else None,
        "latency_p50_s": round(_pct(lat, 50), 4),
        "latency_p99_s": round(_pct(lat, 99), 4),
        "latency_mean_s": round(statistics.fmean(lat), 4) if lat else None,
    }


def _png_encode_seconds(pixels: Any) -> float:
    from omnimodel_runtime.serving.images import encode_png

    started = time.perf_counter()
    encode_png(pixels)
    return time.perf_counter() - started


def _pixel_diff(a: Any, b: Any) -> dict[str, Any]:
    import numpy as np

    diff = np.abs(np.asarray(a, dtype=np.int16) - np.asarray(b, dtype=np.int16))
    return {"max": int(diff.max()), "equal_fraction": round(float((diff == 0).mean()), 6)}


async def _images_concurrently(
    client: _ImagesClient, todo: list[tuple[str, int]], concurrency: int
) -> tuple[list[tuple[tuple[str, int], ImageSample]], float]:
    """``todo`` through ``concurrency`` clients, each sending its next request when its last returns."""
    queue: asyncio.Queue[tuple[str, int]] = asyncio.Queue()
    for item in todo:
        queue.put_nowait(item)
    made: list[tuple[tuple[str, int], ImageSample]] = []

    async def worker() -> None:
        while True:
            try:
                item = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            made.append((item, await client.generate(*item)))

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return made, time.perf_counter() - started


async def _measure_images(args: argparse.Namespace, url: str) -> dict[str, Any]:
    """Latency against diffusers called directly (sequential, interleaved, same prompts and seeds), then
    images/s through the gateway at each concurrency; the batching factor is images/s at the highest
    concurrency over images/s at 1. Pixels are compared too: the gateway's image against diffusers'
    (split equals whole), and each image made in a batch against the same request made alone."""
    params = _image_params(args)
    client = _ImagesClient(url, args.api_key, params)
    result: dict[str, Any] = {}
    pairs = [(IMAGE_PROMPTS[i % len(IMAGE_PROMPTS)], 1000 + i) for i in range(len(IMAGE_PROMPTS))]
    alone: dict[tuple[str, int], Any] = {}
    try:
        client.model = await client.model_id()
        await client.generate(*pairs[0])  # connections, allocator and kernel selection at this size
        direct = None
        if not args.no_direct:
            direct = await asyncio.to_thread(_DirectDiffusers, args, params)
            await asyncio.to_thread(direct.run, *pairs[0])

        async def overhead() -> None:
            assert direct is not None
            d_lat, g_lat, ratios, diffs = [], [], [], []
            for _ in range(args.rounds):
                for prompt, seed in pairs[: args.overhead_prompts]:
                    d = await asyncio.to_thread(direct.run, prompt, seed)
                    g = await client.generate(prompt, seed)
                    g_pixels = await asyncio.to_thread(_png_pixels, g.image)
                    alone[(prompt, seed)] = g_pixels
                    d_lat.append(d.latency)
                    g_lat.append(g.latency)
                    ratios.append(g.latency / d.latency)
                    diffs.append(_pixel_diff(g_pixels, d.image))
            result["overhead"] = {
                "pairs": len(ratios),
                "direct_latency_p50_s": round(_pct(d_lat, 50), 4),
                "gateway_latency_p50_s": round(_pct(g_lat, 50), 4),
                "ratio_of_medians": round(_pct(g_lat, 50) / _pct(d_lat, 50), 4),
                "ratio_p50": round(_pct(ratios, 50), 4),
                "ratio_p99": round(_pct(ratios, 99), 4),
                "added_latency_p50_ms": round((_pct(g_lat, 50) - _pct(d_lat, 50)) * 1000, 2),
                "pixels_equal_to_diffusers": sum(d["max"] == 0 for d in diffs),
                "max_pixel_diff_to_diffusers": max(d["max"] for d in diffs),
                # Part of the gateway's added latency that the direct call does not do: one PNG.
                "png_encode_ms": round(await asyncio.to_thread(_png_encode_seconds, g_pixels) * 1000, 2),
                "direct_latencies_s": [round(v, 4) for v in d_lat],
                "gateway_latencies_s": [round(v, 4) for v in g_lat],
            }

        async def throughput() -> None:
            levels: dict[str, Any] = {}
            batched_diffs = []
            for concurrency in args.image_concurrency:
                count = max(args.image_requests, 2 * concurrency)
                todo = [pairs[i % len(pairs)] for i in range(count)]
                made, wall = await _images_concurrently(client, todo, concurrency)
                samples = [sample for _, sample in made]
                levels[str(concurrency)] = _image_summary(samples, wall, concurrency)
                if concurrency > 1:
                    for item, sample in made:
                        if item in alone:
                            pixels = await asyncio.to_thread(_png_pixels, sample.image)
                            batched_diffs.append(_pixel_diff(pixels, alone[item]))
            result["gateway"] = levels
            low, high = min(args.image_concurrency), max(args.image_concurrency)
            result["batching_factor"] = round(levels[str(high)]["images_per_s"] / levels[str(low)]["images_per_s"], 3)
            result["latency_per_image_s"] = levels[str(low)]["latency_p50_s"]
            if batched_diffs:
                result["batched_vs_alone"] = {
                    "compared": len(batched_diffs),
                    "max_pixel_diff": max(d["max"] for d in batched_diffs),
                    "min_equal_fraction": min(d["equal_fraction"] for d in batched_diffs),
                }

        async def direct_batch() -> None:
            assert direct is not None
            n = max(args.image_concurrency)
            prompts = [pairs[i % len(pairs)][0] for i in range(n)]
            seconds = await asyncio.to_thread(direct.run_batch, prompts, [s for _, s in pairs[:n]])
            result["direct_diffusers_batch"] = {
                "images": n,
                "wall_s": round(seconds, 3),
                "images_per_s": round(n / seconds, 4),
            }

        sections = [("throughput", throughput)]
        if direct is not None:
            sections = [("overhead", overhead), *sections, ("direct_batch", direct_batch)]
        # A run on a lent accelerator may be cut short: what is measured so far is kept in OUT.tmp.
        partial = args.out.with_name(args.out.name + ".tmp") if args.out is not None else None
        for name, section in sections:
            try:
                await section()
            except Exception as err:  # one run's numbers are costly: record the failure, keep measuring
                result.setdefault("errors", {})[name] = f"{type(err).__name__}: {err}"
            if partial is not None:
                partial.parent.mkdir(parents=True, exist_ok=True)
                partial.write_text(json.dumps(result, indent=2) + "\n")
        if partial is not None:
            partial.unlink(missing_ok=True)
    finally:
        await client.aclose()
    return result
