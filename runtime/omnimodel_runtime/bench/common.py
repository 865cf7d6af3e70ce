"""What every benchmark mode shares: deployments on loopback ports, a gateway client, percentiles and a
concurrent driver."""

# Imports sit inside functions on purpose: each mode pulls in only what it needs.
# ruff: noqa: PLC0415

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import httpx

T = TypeVar("T")
R = TypeVar("R")


def pct(values: list[float], q: float) -> float:
    """The ``q``-th percentile (nearest rank); NaN for no values."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def device() -> str:
    """Where this machine runs engines (the direct baselines and the deployed stages alike)."""
    from omnimodel_runtime.engines.devices import resolve_device
    from omnimodel_runtime.settings import RuntimeSettings

    return resolve_device(RuntimeSettings().device)


async def concurrently(fn: Callable[[T], Awaitable[R]], items: Sequence[T], concurrency: int) -> tuple[list[R], float]:
    """``fn`` over ``items`` by ``concurrency`` clients, each sending its next request when its last one
    returned; the results in completion order and the wall time."""
    queue: asyncio.Queue[T] = asyncio.Queue()
    for item in items:
        queue.put_nowait(item)
    results: list[R] = []

    async def worker() -> None:
        while True:
            try:
                item = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            results.append(await fn(item))

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results, time.perf_counter() - started


class GatewayClient:
    """An HTTP client of one gateway (with the API key when given); modes add their requests."""

    def __init__(self, url: str, api_key: str | None) -> None:
        import httpx

        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._client: httpx.AsyncClient = httpx.AsyncClient(base_url=url, headers=headers, timeout=600)
        self.model = ""

    async def model_id(self) -> str:
        resp = await self._client.get("/v1/models")
        resp.raise_for_status()
        model: str = resp.json()["data"][0]["id"]
        return model

    async def sse_chunks(self, path: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """The JSON chunks of a streamed response (``[DONE]`` left out); an error chunk is raised."""
        async with self._client.stream("POST", path, json=body) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk: dict[str, Any] = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"]["message"])
                yield chunk

    async def aclose(self) -> None:
        await self._client.aclose()


def latency_ratios(direct: list[float], gateway: list[float], ratios: list[float]) -> dict[str, Any]:
    """Gateway against direct latencies of the same requests, measured in alternation."""
    return {
        "direct_latency_p50_s": round(pct(direct, 50), 4),
        "gateway_latency_p50_s": round(pct(gateway, 50), 4),
        "ratio_of_medians": round(pct(gateway, 50) / pct(direct, 50), 4),
        "ratio_p50": round(pct(ratios, 50), 4),
        "ratio_p99": round(pct(ratios, 99), 4),
        "added_latency_p50_ms": round((pct(gateway, 50) - pct(direct, 50)) * 1000, 2),
    }


@contextlib.contextmanager
def deployment(
    args: argparse.Namespace, workdir: Path, *, single_stage: bool = False, stage_urls: list[str] | None = None
) -> Iterator[str]:
    """One ``omnimodel stage`` process per stage and an ``omnimodel gateway`` from one pipeline file, on
    loopback ports, so every request crosses both HTTP hops as in a cluster; yield the gateway URL (and
    add each stage's URL to ``stage_urls``, where its ``/metrics`` are)."""
    from omnimodel_runtime.bench import engine_args
    from omnimodel_runtime.serve import serve_pipeline

    base = serve_pipeline(
        args.preset, args.model, engines=[args.engine], engine_args=engine_args(args) or None, device=device()
    )
    if single_stage and len(base.stages) != 1:
        raise SystemExit("bench deploys single-stage presets only (pass --url for others)")
    ports = {s.name: free_port() for s in base.stages}
    stages = tuple(s.model_copy(update={"endpoints": (f"http://127.0.0.1:{ports[s.name]}",)}) for s in base.stages)
    if stage_urls is not None:
        stage_urls.extend(f"http://127.0.0.1:{port}" for port in ports.values())
    path = workdir / "pipeline.json"
    path.write_text(base.model_copy(update={"stages": stages}).to_json())
    gateway_port = free_port()
    commands = [
        (name, ["stage", "--pipeline", str(path), "--stage", name, "--port", str(port)]) for name, port in ports.items()
    ]
    commands.append(("gateway", ["gateway", "--pipeline", str(path), "--port", str(gateway_port)]))
    with _processes(commands, workdir) as procs:
        url = f"http://127.0.0.1:{gateway_port}"
        wait_healthy(url, procs, workdir, args.start_timeout)
        yield url


@contextlib.contextmanager
def serve_process(args: argparse.Namespace, workdir: Path) -> Iterator[str]:
    """``omnimodel serve``: the gateway and every stage in one process (in-memory hand-off)."""
    port = free_port()
    command = ["serve", "--preset", args.preset, "--model", args.model, "--engine", args.engine, "--port", str(port)]
    for item in getattr(args, "engine_arg", None) or ():
        command += ["--engine-arg", item]
    with _processes([("serve", command)], workdir) as procs:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, procs, workdir, args.start_timeout)
        yield url


@contextlib.contextmanager
def _processes(commands: list[tuple[str, list[str]]], workdir: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``omnimodel <command>`` processes, each logging to ``<workdir>/<name>.log``; stopped on exit
    (SIGTERM, then SIGKILL after 30 s)."""
    env = {**os.environ, "OMNIMODEL_LOG_LEVEL": "warning"}
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    try:
        for name, extra in commands:
            log = (workdir / f"{name}.log").open("wb")
            logs.append(log)
            cmd = [sys.executable, "-m", "omnimodel_runtime", *extra]
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
        yield procs
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
        keep = os.environ.get("OMNIMODEL_BENCH_LOGS")
        if keep:  # the processes' logs outlive the benchmark's temporary directory
            Path(keep).mkdir(parents=True, exist_ok=True)
            for name, _ in commands:
                src = workdir / f"{name}.log"
                if src.is_file():
                    (Path(keep) / f"{workdir.name}-{name}.log").write_bytes(src.read_bytes())


def wait_healthy(url: str, procs: list[subprocess.Popen[bytes]], workdir: Path, timeout: float) -> None:
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


async def run_sections(sections: Sequence[tuple[str, Callable[[], Awaitable[None]]]], result: dict[str, Any]) -> None:
    """Run each section; a failing one is recorded under ``errors`` and the others still run (one run's
    numbers are costly)."""
    for name, section in sections:
        try:
            await section()
        except Exception as err:
            result.setdefault("errors", {})[name] = f"{type(err).__name__}: {err}"
