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
from typing import Any, Final

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
    p.add_argument("--engine", default="transformers", choices=["transformers", "vllm"])
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests", type=int, default=32, help="requests per concurrency run")
    p.add_argument("--rounds", type=int, default=3, help="sequential interleaved rounds over the prompts")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--api-key", default=None)
    p.add_argument("--no-direct", action="store_true", help="skip the in-process engine baseline")
    p.add_argument("--out", type=Path, default=None, help="write the JSON here (default: stdout only)")
    p.add_argument("--start-timeout", type=float, default=300.0)


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
        from omnimodel_runtime.engines.base import StageInput
        from omnimodel_runtime.protocol.stage import FinalFrame, SamplingParams, StageRequest, TextFrame

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
    from omnimodel_runtime.gateway import serve_pipeline

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
    from omnimodel_runtime.gateway import serve_pipeline
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
    with tempfile.TemporaryDirectory(prefix="omnimodel-bench-") as tmp, contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(_deployment(args, Path(tmp)))
        results = asyncio.run(_measure(args, url))
    report = {"meta": meta, "results": results}
    text = json.dumps(report, indent=2) + "\n"
    print(text, end="")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0
