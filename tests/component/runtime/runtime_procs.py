"""Helpers for runtime component tests: runtime processes on loopback ports, polled with deadlines; the
``serve`` app in the test's own process and event loop (in memory, or over real TCP); and what reads their
answers (SSE chunks, WAV and PNG files). Stage engines without the app: stage_engines.py.

A plain module (not conftest) so test files can import it by its unique name.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import subprocess
import sys
import wave
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import httpx
import numpy as np
import openai
import pytest
import pytest_asyncio
import uvicorn
from fastapi import FastAPI

from omnimodel_testbed.procs import free_port, poll, terminate

if TYPE_CHECKING:
    from omnimodel_runtime.pipeline import Pipeline

T = TypeVar("T")


def wait_for(predicate: Callable[[], T | None], *, timeout: float, what: str, interval: float = 0.05) -> T:
    """Poll ``predicate`` until it returns something truthy; fail naming ``what`` after ``timeout``."""
    return poll(predicate, timeout=timeout, what=what, interval=interval)


@contextmanager
def torch_threads(count: int | None) -> Iterator[None]:
    """torch's intra-op thread count set to ``count`` (``None``: left as it is) while the context is open."""
    import torch

    previous = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


# ------------------------------------------------------------------------------ runtime processes


class RuntimeProcess:
    """One ``python -m omnimodel_runtime ...`` process, logging to a file, stopped by its PID."""

    def __init__(
        self,
        name: str,
        args: list[str],
        *,
        log_dir: Path,
        env: Mapping[str, str],
        port: int,
        wrapper: Sequence[str] = (),
    ) -> None:
        self.name = name
        self.args = args
        # A command the process runs under, e.g. ("taskset", "-c", "0"); it must exec the runtime (one PID).
        self.wrapper = tuple(wrapper)
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_dir / f"{name}-{port}.log"
        self._env = dict(env)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> RuntimeProcess:
        log = self.log_path.open("ab")
        command = [*self.wrapper, sys.executable, "-m", "omnimodel_runtime", *self.args]
        self.proc = subprocess.Popen(
            [*command, "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self._env,
        )
        log.close()
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path.exists() else ""

    def get(self, path: str, timeout: float = 2.0) -> httpx.Response | None:
        try:
            return httpx.get(f"{self.url}{path}", timeout=timeout)
        except httpx.HTTPError:
            return None

    def wait_healthy(self, timeout: float = 120.0) -> RuntimeProcess:
        def ready() -> bool:
            if not self.alive:
                raise AssertionError(f"{self.name} exited with {self.returncode}:\n{self.log_tail()}")
            resp = self.get("/health")
            return resp is not None and resp.status_code == 200

        wait_for(ready, timeout=timeout, what=f"{self.name} /health to turn 200")
        return self

    def metrics(self) -> str:
        """Its /metrics text."""
        resp = self.get("/metrics")
        assert resp is not None, f"{self.name} did not answer /metrics"
        return resp.text

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL: the process dies with no chance to clean up (a crashed pod)."""
        if self.alive:
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL if it does not exit within ``timeout``."""
        return None if self.proc is None else terminate(self.proc, grace=timeout)


@contextmanager
def running(*procs: RuntimeProcess) -> Iterator[tuple[RuntimeProcess, ...]]:
    """Start ``procs`` and stop every one of them on the way out, whatever happens."""
    try:
        for p in procs:
            p.start()
        yield procs
    finally:
        for p in procs:
            p.stop()


def runtime_env(model_cache: Path, **extra: Any) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNIMODEL_")}
    env.update({"OMNIMODEL_MODEL_CACHE": str(model_cache), "OMNIMODEL_LOG_LEVEL": "info"})
    env.update({k: str(v) for k, v in extra.items()})
    return env


def serve_process(preset: str, log_dir: Path, env: Mapping[str, str], *args: str, model: str = "") -> RuntimeProcess:
    """``omnimodel serve --preset PRESET --model MODEL ARGS`` (``model`` by default the preset's tiny model)
    on a free port, not started yet."""
    command = ["serve", "--preset", preset, "--model", model or f"tiny://{preset}", *args]
    return RuntimeProcess("serve", command, log_dir=log_dir, env=env, port=free_port())


def pipeline_file(pipeline: Pipeline, ports: Mapping[str, Sequence[int]], path: Path) -> Path:
    """``pipeline``, each stage served on the loopback ``ports`` given for it, written to ``path``: the
    pipeline file ``omnimodel stage`` and ``omnimodel gateway`` processes read."""
    stages = tuple(
        s.model_copy(update={"endpoints": tuple(f"http://127.0.0.1:{p}" for p in ports[s.name])})
        for s in pipeline.stages
    )
    path.write_text(pipeline.model_copy(update={"stages": stages}).to_json())
    return path


def stage_process(path: Path, stage: str, port: int, *, log_dir: Path, env: Mapping[str, str]) -> RuntimeProcess:
    """``omnimodel stage --pipeline PATH --stage STAGE`` on ``port`` (the one the pipeline file gives it)."""
    return RuntimeProcess(
        stage, ["stage", "--pipeline", str(path), "--stage", stage], log_dir=log_dir, env=env, port=port
    )


def gateway_process(path: Path, *, log_dir: Path, env: Mapping[str, str]) -> RuntimeProcess:
    """``omnimodel gateway --pipeline PATH`` on a free port."""
    return RuntimeProcess("gateway", ["gateway", "--pipeline", str(path)], log_dir=log_dir, env=env, port=free_port())


@contextmanager
def split_deployment(
    pipeline: Pipeline, log_dir: Path, env: Mapping[str, str], *, timeout: float = 120.0
) -> Iterator[dict[str, RuntimeProcess]]:
    """An ``omnimodel stage`` process for each stage of ``pipeline`` and an ``omnimodel gateway`` in front,
    from one pipeline file: started together, healthy when yielded (by stage name, and ``"gateway"``),
    stopped on the way out."""
    ports = {s.name: free_port() for s in pipeline.stages}
    path = pipeline_file(pipeline, {name: (port,) for name, port in ports.items()}, log_dir / "pipeline.json")
    deployment = {name: stage_process(path, name, port, log_dir=log_dir, env=env) for name, port in ports.items()}
    deployment["gateway"] = gateway_process(path, log_dir=log_dir, env=env)
    with running(*deployment.values()):
        for proc in deployment.values():
            proc.wait_healthy(timeout=timeout)
        yield deployment


# Every client openai_client made, closed by close_openai_clients at the end of the session: a client
# collected with its keep-alive sockets open warns "unclosed socket" in whichever test runs then (warnings
# are errors), failing a test that did nothing wrong.
_CLIENTS: list[openai.OpenAI] = []


def openai_client(url: str, *, timeout: float = 120.0) -> openai.OpenAI:
    """The official client of the server at ``url``; no retries, so a failure shows at once."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=timeout)
    _CLIENTS.append(client)
    return client


def close_openai_clients() -> None:
    while _CLIENTS:
        _CLIENTS.pop().close()


# -------------------------------------------------------------------------- metrics


def _samples(text: str, name: str, labels: Mapping[str, str] | None) -> Iterator[float]:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in (labels or {}).items()):
                yield float(sample.value)


def metric_value(text: str, name: str, labels: Mapping[str, str] | None = None) -> float | None:
    """One sample from a Prometheus text exposition (``None`` when absent)."""
    return next(_samples(text, name, labels), None)


def metric_total(text: str, name: str, labels: Mapping[str, str] | None = None) -> float:
    """The sum of every sample of ``name`` with ``labels`` (whatever its other labels), 0 when none."""
    return sum(_samples(text, name, labels))


def stage_requests(metrics: str, stage: str) -> float:
    """Finished requests of ``stage`` (any outcome) in a Prometheus exposition."""
    return metric_total(metrics, "omnimodel_stage_requests_total", {"stage": stage})


# --------------------------------------------------------------------- the serve app in this process


@dataclass
class Served:
    """``omnimodel serve``'s app running in this process, and clients of it in memory."""

    app: FastAPI
    http: httpx.AsyncClient

    @cached_property
    def openai(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="unused", http_client=self.http, max_retries=0)

    def engine(self, stage: str) -> Any:
        """The engine of ``stage``."""
        return self.app.state.orchestrator.handles[stage].engine


@asynccontextmanager
async def served_in_process(
    pipeline: Pipeline, model_cache: Path, *, http_timeout: float = 120.0, **settings: Any
) -> AsyncIterator[Served]:
    """``omnimodel serve``'s app of ``pipeline``, every stage in this process on the CPU, frames handed over
    in memory: started and warm when yielded, with an httpx client of it (``http://gateway``). ``settings``:
    more of its :class:`RuntimeSettings`."""
    from omnimodel_runtime.serve import build_serve_app
    from omnimodel_runtime.settings import RuntimeSettings

    app = build_serve_app(RuntimeSettings(model_cache=model_cache, device="cpu", **settings), pipeline)
    async with app.router.lifespan_context(app):
        await app.state.startup.wait()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=http_timeout) as http:
            yield Served(app, http)


def serve_fixture(preset: str, tiny: str) -> Any:
    """A module fixture: ``omnimodel serve --preset PRESET --model tiny://PRESET``'s app in this process
    (:func:`served_in_process`), the model built by the session fixture named ``tiny``. Its name is the one
    it is bound to in the test module."""

    @pytest_asyncio.fixture(scope="module", loop_scope="module")
    async def serve(request: pytest.FixtureRequest, model_cache: Path) -> AsyncIterator[Served]:
        from omnimodel_runtime.serve import serve_pipeline

        request.getfixturevalue(tiny)
        async with served_in_process(serve_pipeline(preset, f"tiny://{preset}", device="cpu"), model_cache) as served:
            yield served

    return serve


@asynccontextmanager
async def served_over_tcp(app: FastAPI) -> AsyncIterator[str]:
    """``app`` (its lifespan already running) behind a real uvicorn server on a loopback port, in this event
    loop; yields its URL. httpx's ASGI transport buffers whole responses and never disconnects, which
    would hide what a real client does to a stream."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            assert not task.done(), "the server failed to start"
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


async def streamed_chat_over_tcp(app: FastAPI, **create: Any) -> list[dict[str, Any]]:
    """The chunks of the streamed chat answer ``app`` (its lifespan already running) gives the official
    client over real TCP (:func:`served_over_tcp`); ``create``: the arguments of its
    ``chat.completions.create`` but ``stream``."""
    async with (
        served_over_tcp(app) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client,
    ):
        stream = await client.chat.completions.create(**create, stream=True)
        return [chunk.model_dump() async for chunk in stream]


async def hang_up_after_the_first_text(url: str, body: Mapping[str, Any]) -> None:
    """POST the streamed chat ``body`` to the server at ``url`` over TCP and close the connection as soon as
    a text delta arrives: a client that goes away while the thinker writes."""
    async with (
        httpx.AsyncClient(base_url=url, timeout=60) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                break  # leaving the stream unread closes its connection


# ------------------------------------------------------------------------- answers and media


def sse_chunks(body: str) -> list[dict[str, Any]]:
    """The JSON chunks of a whole SSE answer (checked: it ends with ``data: [DONE]``)."""
    events = [line[6:] for line in body.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def _deltas(chunks: Iterable[Mapping[str, Any]]) -> Iterator[Mapping[str, Any]]:
    return (c["choices"][0]["delta"] for c in chunks if c["choices"])


def streamed_text(chunks: Iterable[Mapping[str, Any]]) -> str:
    """The text of a streamed chat answer's chunks."""
    return "".join(d.get("content") or "" for d in _deltas(chunks))


def streamed_audio(chunks: Iterable[Mapping[str, Any]]) -> list[bytes]:
    """The PCM pieces of a streamed spoken answer's audio deltas, in order."""
    return [base64.b64decode(d["audio"]["data"]) for d in _deltas(chunks) if (d.get("audio") or {}).get("data")]


def wav_samples(data: bytes, rate: int = 24000) -> np.ndarray:
    """The samples of a WAV file (checked: RIFF, ``rate``, mono, 16-bit)."""
    assert data[:4] == b"RIFF"
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (rate, 1, 2)
        return np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")


def wav_of(message: Mapping[str, Any]) -> bytes:
    """The WAV file of a chat answer's ``message.audio`` (checked: 24 kHz, mono, 16-bit, not empty)."""
    data = base64.b64decode(message["audio"]["data"])
    assert wav_samples(data).size > 0
    return data


def random_png(width: int, height: int, seed: int) -> bytes:
    """A PNG of random pixels (a flat image would hide a wrong crop or resize)."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def png_pixels(b64: str) -> np.ndarray:
    """The pixels of a base64 PNG file (checked: it is a PNG)."""
    from PIL import Image

    raw = base64.b64decode(b64)
    assert raw.startswith(b"\x89PNG\r\n\x1a\n")
    return np.asarray(Image.open(io.BytesIO(raw)))


def images_api_pixels(result: Any) -> list[np.ndarray]:
    """The pixels of each image of an images API answer of the ``openai`` client."""
    assert result.data is not None
    return [png_pixels(d.b64_json) for d in result.data]
