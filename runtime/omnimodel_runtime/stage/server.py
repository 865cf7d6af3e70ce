"""The stage server: one stage's engine behind the frame protocol (``omnimodel stage``).

Endpoints: ``POST /v1/stage/generate`` (frames in, frames out), ``GET /health`` (503 until the engine
is loaded and warm), ``GET /livez`` (200 while the process is usable; 503 once start-up failed, so the
kubelet restarts it), ``GET /metrics``, ``GET /v1/stage/info``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry

from omnimodel_runtime.engines.base import Engine
from omnimodel_runtime.engines.registry import load_engine
from omnimodel_runtime.errors import RuntimeSetupError, StageError
from omnimodel_runtime.metrics import StageMetrics, instrumented
from omnimodel_runtime.pipeline import Pipeline
from omnimodel_runtime.protocol.frames import MEDIA_TYPE, FrameError, aiter_frames, encode_frame_bytes
from omnimodel_runtime.protocol.stage import (
    GENERATE_PATH,
    INFO_PATH,
    ErrorFrame,
    RequestFrame,
    ResponseFrame,
    StageInput,
)
from omnimodel_runtime.settings import RuntimeSettings
from omnimodel_runtime.stage.info import stage_info
from omnimodel_runtime.web import probes
from omnimodel_runtime.web.access import AccessLogMiddleware
from omnimodel_runtime.web.limits import BodyLimitMiddleware
from omnimodel_runtime.web.startup import Startup
from omnimodel_runtime.web.streaming import StreamResponse

log = logging.getLogger(__name__)


def _frame_error(status: int, message: str) -> Response:
    body = encode_frame_bytes(ErrorFrame(message=message, status=status, type="invalid_request_error"))
    return Response(body, status_code=status, media_type=MEDIA_TYPE)


def build_stage_app(
    settings: RuntimeSettings,
    pipeline: Pipeline,
    stage_name: str,
    *,
    engine: Engine | None = None,
) -> FastAPI:
    """The ASGI app of one stage. ``engine`` injects a ready-made engine (tests); by default the
    stage's adapter is created from the pipeline file and loaded in the background at start-up."""
    try:
        stage = pipeline.stage(stage_name)
    except KeyError:
        names = ", ".join(s.name for s in pipeline.stages)
        raise RuntimeSetupError(f"pipeline {pipeline.name!r} has no stage {stage_name!r} (it has {names})") from None

    registry = CollectorRegistry()
    metrics = StageMetrics(registry, stage.name)
    startup = Startup()
    holder: dict[str, Engine] = {}
    if engine is not None:
        holder["engine"] = engine

    async def start() -> None:
        log.info(
            "Stage %s: loading the %s engine (task %s, model %s)",
            stage.name,
            stage.engine.value,
            stage.task,
            pipeline.model.source,
        )
        eng = holder.get("engine")
        if eng is None:
            eng = await load_engine(stage, pipeline.model, settings, metrics)
            holder["engine"] = eng
        metrics.track_queue_depth(eng.queue_depth)
        metrics.track_work(eng.work)
        holder["started"] = eng
        await eng.start()
        log.info("Stage %s: warming up", stage.name)
        await eng.warmup()
        log.info("Stage %s is ready (%s engine)", stage.name, stage.engine.value)

    async def stop() -> None:
        started = holder.get("started")
        if started is not None:
            await started.stop()

    app = FastAPI(
        title=f"OmniModel stage {stage.name}", lifespan=startup.lifespan(start, stop), docs_url=None, redoc_url=None
    )
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.stage_max_body_bytes)
    app.add_middleware(AccessLogMiddleware, quiet_paths=probes.PROBE_PATHS)
    app.state.startup = startup

    @app.get("/livez")
    async def livez() -> JSONResponse:
        return probes.livez(startup)

    @app.get("/health")
    async def health() -> JSONResponse:
        body = {"stage": stage.name, **startup.describe()}
        return JSONResponse(body, status_code=200 if startup.ready else 503)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return probes.metrics(registry)

    @app.get(INFO_PATH)
    async def info() -> JSONResponse:
        described = await stage_info(
            pipeline, stage, holder.get("engine"), status=startup.phase.value, error=startup.error
        )
        return JSONResponse(described.model_dump(mode="json"))

    @app.post(GENERATE_PATH)
    async def generate(request: Request) -> Response:
        eng = holder.get("engine")
        if not startup.ready or eng is None:
            return _frame_error(503, f"stage {stage.name!r} is not ready ({startup.phase.value})")
        frames = aiter_frames(request.stream(), max_frame_bytes=settings.stage_max_body_bytes)
        try:
            first = await anext(frames)
        except StopAsyncIteration:
            return _frame_error(400, "empty request body: expected a request frame")
        except FrameError as err:
            return _frame_error(400, f"malformed request body: {err}")
        if not isinstance(first, RequestFrame):
            return _frame_error(400, "a request body must start with a request frame")

        # Frames after the request frame are the upstream stage's output, streamed while it generates.
        upstream: asyncio.Queue[ResponseFrame | None] = asyncio.Queue()

        async def drain_body() -> None:
            try:
                async for frame in frames:
                    if isinstance(frame, RequestFrame):
                        raise FrameError("a second request frame in one body")
                    await upstream.put(frame)
            finally:
                await upstream.put(None)

        async def upstream_frames() -> AsyncIterator[ResponseFrame]:
            while (frame := await upstream.get()) is not None:
                yield frame

        inp = StageInput(
            request=first.request,
            tensors=first.tensors,
            upstream=upstream_frames() if stage.inputs else None,
        )

        async def produce() -> AsyncIterator[bytes]:
            try:
                async for frame in instrumented(eng.generate(inp), metrics):
                    yield encode_frame_bytes(frame)
            except StageError as err:
                yield encode_frame_bytes(ErrorFrame.from_error(err))
            except Exception as err:
                log.exception("Request %s failed in stage %s", first.request.request_id, stage.name)
                yield encode_frame_bytes(ErrorFrame(f"stage {stage.name!r} failed: {err}", status=500))

        return StreamResponse(produce(), media_type=MEDIA_TYPE, drain_body=drain_body)

    return app
