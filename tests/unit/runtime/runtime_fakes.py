"""Helpers for runtime unit tests: a scriptable fake engine and apps served through ASGI (no sockets).

A plain module (not conftest) so test files can import it by its unique name."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import uvicorn
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from omnimodel_runtime.engines.base import Engine, EngineContext
from omnimodel_runtime.errors import StageError
from omnimodel_runtime.gateway import build_app
from omnimodel_runtime.metrics import StageMetrics, StageMetricsFamily
from omnimodel_runtime.pipeline import ModelSource, Pipeline, Stage, get_preset
from omnimodel_runtime.protocol.stage import FinalFrame, ResponseFrame, StageInput, TextFrame, Usage
from omnimodel_runtime.serve import serve_pipeline
from omnimodel_runtime.settings import RuntimeSettings
from omnimodel_runtime.stage.handle import StageHandle
from omnimodel_runtime.stage.local import LocalStage


class FakeEngine(Engine):
    """Answers ``max_tokens`` words " w0 w1 ..."; the prompt steers failures:

    - ``FAIL_BEFORE`` raises a 500 before any output, ``FAIL_AFTER`` after the first word,
      ``REJECT`` raises a 400 (as engines do for a prompt that does not fit).
    - ``HOLD`` waits on :attr:`release` after the first word (for cancellation tests).
    """

    def __init__(self, context: EngineContext, *, gate: asyncio.Event | None = None) -> None:
        super().__init__(context)
        self.gate = gate
        self.release = asyncio.Event()
        self.requests: list[StageInput] = []
        self.cancelled: list[str] = []
        self.started = False
        self.stopped = False

    async def start(self) -> None:
        if self.gate is not None:
            await self.gate.wait()
        self.started = True

    async def stop(self) -> None:
        self.stopped = True

    @staticmethod
    def prompt_text(inp: StageInput) -> str:
        r = inp.request
        if r.messages:
            content = r.messages[-1].get("content", "")
            return content if isinstance(content, str) else " ".join(p.get("text", "") for p in content)
        return r.prompt or " ".join(map(str, r.prompt_token_ids or ()))

    async def generate(self, inp: StageInput) -> AsyncIterator[ResponseFrame]:
        self.requests.append(inp)
        prompt = self.prompt_text(inp)
        if "REJECT" in prompt:
            raise StageError("the prompt does not fit", status=400, param="messages")
        if "FAIL_BEFORE" in prompt:
            raise StageError("engine exploded", status=500)
        n = inp.request.sampling.max_tokens or 5
        try:
            for i in range(n):
                yield TextFrame(text=f" w{i}", token_ids=(100 + i,))
                if i == 0 and "FAIL_AFTER" in prompt:
                    raise StageError("engine exploded mid-stream", status=500)
                if i == 0 and "HOLD" in prompt:
                    await self.release.wait()
            yield FinalFrame("length", Usage(prompt_tokens=len(prompt.split()), completion_tokens=n))
        except (GeneratorExit, asyncio.CancelledError):
            self.cancelled.append(inp.request.request_id)
            raise


def text_pipeline(*, endpoints: tuple[str, ...] = ()) -> Pipeline:
    pipeline = serve_pipeline("text", "tiny://text", engines=["transformers"], device="cpu")
    if endpoints:
        stages = tuple(s.model_copy(update={"endpoints": endpoints}) for s in pipeline.stages)
        pipeline = pipeline.model_copy(update={"stages": stages})
    return pipeline


def fake_context(stage: Stage, metrics: StageMetrics | None = None) -> EngineContext:
    kwargs: dict[str, Any] = {"metrics": metrics} if metrics is not None else {}
    return EngineContext(stage=stage, model_dir=Path("/nonexistent"), settings=RuntimeSettings(), **kwargs)


@asynccontextmanager
async def lifespan(app: FastAPI, *, wait: bool = True) -> AsyncIterator[FastAPI]:
    """Run the app's lifespan (ASGITransport does not) and, by default, wait until it is warm."""
    async with app.router.lifespan_context(app):
        if wait:
            await app.state.startup.wait()
        yield app


def asgi_client(app: FastAPI, **kwargs: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway", **kwargs)


def openai_client(http: httpx.AsyncClient, api_key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://gateway/v1", api_key=api_key, http_client=http, max_retries=0)


class FakeServe:
    """A ``serve``-shaped gateway app whose stages are :class:`FakeEngine` instances."""

    def __init__(
        self,
        pipeline: Pipeline | None = None,
        *,
        settings: RuntimeSettings | None = None,
        gate: asyncio.Event | None = None,
    ) -> None:
        self.pipeline = pipeline or text_pipeline()
        self.settings = settings or RuntimeSettings()
        registry = CollectorRegistry()
        family = StageMetricsFamily(registry)
        self.engines: dict[str, FakeEngine] = {}
        handles: dict[str, StageHandle] = {}
        for stage in self.pipeline.stages:
            metrics = family.for_stage(stage.name)
            engine = FakeEngine(fake_context(stage, metrics), gate=gate)
            self.engines[stage.name] = engine
            handles[stage.name] = LocalStage(stage, engine, metrics)
        self.app = build_app(self.settings, self.pipeline, handles, registry=registry)

    @property
    def engine(self) -> FakeEngine:
        return self.engines[self.pipeline.entry.name]


def omni_pipeline() -> Pipeline:
    return get_preset("qwen2.5-omni").pipeline(ModelSource(source="tiny://qwen2.5-omni"))


def sse_events(body: str) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order."""
    return [line[len("data: ") :] for line in body.splitlines() if line.startswith("data: ")]


Factory = Callable[..., Mapping[str, Any]]


# A tiny-model builder for cache tests: counts its calls and can be told to fail.
BUILDS: list[Path] = []
FAIL_BUILDS: list[bool] = []


def build_counting(out: Path, *, seed: int) -> None:
    import time

    BUILDS.append(out)
    (out / "weights.bin").write_bytes(bytes([seed % 256]) * 16)
    time.sleep(0.05)  # widen the window in which a second builder could sneak in (it must not)
    if FAIL_BUILDS and FAIL_BUILDS[-1]:
        raise RuntimeError("build failed halfway")
    (out / "config.json").write_text("{}")


async def serve_on_loopback(app: FastAPI, stack: AsyncExitStack, *, wait: bool = True) -> str:
    """A real uvicorn server on 127.0.0.1 in this event loop, running the app's lifespan, until ``stack``
    closes: httpx's ASGI transport buffers whole responses, so it can show neither chunks arriving nor
    a stream cut short. By default it returns once the app is warm (``wait=False``: once it listens)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    task = asyncio.create_task(server.serve())

    async def shutdown() -> None:
        server.should_exit = True
        await task

    stack.push_async_callback(shutdown)
    while not server.started:
        assert not task.done(), "stage server failed to start"
        await asyncio.sleep(0.01)
    if wait:
        await app.state.startup.wait()
    return f"http://127.0.0.1:{port}"
