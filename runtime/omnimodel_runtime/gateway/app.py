"""The gateway app: the OpenAI routes of what the pipeline serves, over stage handles, plus probes.

:func:`build_app` is the app of both gateway processes: ``omnimodel gateway`` (remote stages,
:func:`build_gateway_app`) and ``omnimodel serve`` (in-process stages, :mod:`omnimodel_runtime.serve`); the
routes cannot tell the difference.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from omnimodel_runtime.api import chat, completions, images, models, speech, videos
from omnimodel_runtime.api.errors import body_too_large, install_error_handlers
from omnimodel_runtime.api.openapi import errors, install_openapi, ok, probe
from omnimodel_runtime.api.state import APIState
from omnimodel_runtime.metrics import GatewayMetrics, StageTraffic
from omnimodel_runtime.pipeline import Pipeline, Route
from omnimodel_runtime.serving.images import answers_chat_with_images
from omnimodel_runtime.serving.media import MediaPolicy
from omnimodel_runtime.serving.orchestrator import Orchestrator
from omnimodel_runtime.settings import RuntimeSettings
from omnimodel_runtime.stage.handle import StageHandle
from omnimodel_runtime.stage.remote import RemoteStage
from omnimodel_runtime.web import probes
from omnimodel_runtime.web.access import AccessLogMiddleware
from omnimodel_runtime.web.limits import BodyLimitMiddleware
from omnimodel_runtime.web.probes import PROBE_PATHS
from omnimodel_runtime.web.startup import Startup

log = logging.getLogger(__name__)


def build_gateway_app(settings: RuntimeSettings, pipeline: Pipeline) -> FastAPI:
    """``omnimodel gateway``: every stage reached over HTTP at the endpoints in the pipeline file."""
    registry = CollectorRegistry()
    traffic = StageTraffic(registry)
    handles: dict[str, StageHandle] = {s.name: RemoteStage(s, settings, traffic=traffic) for s in pipeline.stages}
    return build_app(settings, pipeline, handles, registry=registry)


def build_app(
    settings: RuntimeSettings,
    pipeline: Pipeline,
    handles: Mapping[str, StageHandle],
    *,
    registry: CollectorRegistry | None = None,
) -> FastAPI:
    """The gateway ASGI app. ``handles`` maps each stage name to a local or remote handle; the app
    starts them in the background at start-up and stops them at shutdown."""
    registry = registry or CollectorRegistry()
    metrics = GatewayMetrics(registry)
    orchestrator = Orchestrator(pipeline, handles)
    startup = Startup()
    watchers: list[asyncio.Task[None]] = []

    async def start() -> None:
        log.info(
            "Pipeline %s: model %s, stages %s; serving %s",
            pipeline.name,
            pipeline.model.source,
            " -> ".join(s.name for s in pipeline.stages),
            ", ".join(sorted(served)),
        )
        began = time.monotonic()
        await asyncio.gather(*(h.start() for h in handles.values()))
        watchers.append(asyncio.create_task(announce_ready(began)))

    async def announce_ready(began: float) -> None:
        """One line when every stage first is reachable and warm (what turns /health 200)."""
        if not orchestrator.ready:
            waiting = ", ".join(name for name, h in handles.items() if not h.ready)
            log.info("Waiting for stages %s (GET /health answers 503 until every stage is warm)", waiting)
        # Readiness is a property of every handle (remote endpoints flip in their own pollers), read
        # here as /health reads it; an event would need every handle kind to signal it.
        while not orchestrator.ready:  # noqa: ASYNC110
            await asyncio.sleep(0.1)
        log.info("Every stage is ready (%.1f s): serving %s", time.monotonic() - began, pipeline.model.name)

    async def stop() -> None:
        for watcher in watchers:
            watcher.cancel()
        await app.state.api.videos.close()
        await asyncio.gather(*(h.stop() for h in handles.values()), return_exceptions=True)

    app = FastAPI(
        title=f"OmniModel {pipeline.name}", lifespan=startup.lifespan(start, stop), docs_url=None, redoc_url=None
    )
    app.state.startup = startup
    app.state.orchestrator = orchestrator
    app.state.api = APIState.create(
        orchestrator,
        request_timeout=settings.request_timeout,
        api_key=settings.api_key.get_secret_value() if settings.api_key else None,
        chat_modalities=settings.chat_default_modalities,
        media=MediaPolicy(fetch=settings.media_fetch, max_bytes=settings.media_max_bytes),
    )
    install_error_handlers(app)
    install_openapi(app)

    # Routes only for what the pipeline serves.
    app.include_router(models.router)
    served = {models.PATH}
    if Route.CHAT in pipeline.routes:
        app.include_router(chat.image_router if answers_chat_with_images(pipeline) else chat.router)
        served.add(chat.PATH)
    if Route.COMPLETIONS in pipeline.routes:
        app.include_router(completions.router)
        served.add(completions.PATH)
    if Route.IMAGES in pipeline.routes:
        app.include_router(images.router)
        served.add(images.PATH)
    if Route.IMAGE_EDITS in pipeline.routes:
        app.include_router(images.edits_router)
        served.add(images.EDITS_PATH)
    if Route.SPEECH in pipeline.routes:
        app.include_router(speech.router)
        served.add(speech.PATH)
    if Route.VIDEOS in pipeline.routes:
        app.include_router(videos.router)
        served.add(videos.PATH)

    # Added last = outermost: requests refused for size are counted (and the access log sees everything).
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes, error_body=body_too_large)
    app.add_middleware(RequestMetrics, metrics=metrics, routes=frozenset(served))
    app.add_middleware(AccessLogMiddleware, quiet_paths=PROBE_PATHS)

    @app.get("/livez", responses=probe("The process is usable", 200) | probe("Start-up failed", 503))
    async def livez() -> JSONResponse:
        return probes.livez(startup)

    @app.get(
        "/health",
        responses=probe("Every stage is reachable and warm", 200)
        | probe("Starting, or a stage is unavailable (`stages` says which)", 503),
    )
    async def health() -> JSONResponse:
        """200 once every stage is reachable and warm; 503 before, and again when a stage is lost."""
        ready = startup.ready and orchestrator.ready
        for name, handle in handles.items():
            metrics.stage_up(name, handle.ready)
        body = {
            **startup.describe(),
            "status": "ok" if ready else ("unavailable" if startup.ready else startup.phase.value),
            "stages": orchestrator.describe(),
        }
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get(
        "/metrics",
        response_class=Response,
        responses=ok("Prometheus text exposition", {"text/plain": {"schema": {"type": "string"}}}) | errors(500),
    )
    async def metrics_endpoint() -> Response:
        return probes.metrics(registry)

    return app


class RequestMetrics:
    """ASGI middleware timing each API request until its last body byte (streams included)."""

    def __init__(self, app: ASGIApp, *, metrics: GatewayMetrics, routes: frozenset[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.routes:
            await self.app(scope, receive, send)
            return
        started, status = time.perf_counter(), 500
        self.metrics.started()

        async def tracking(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, tracking)
        finally:
            self.metrics.finished(scope["path"], status, time.perf_counter() - started)
