"""The gateway app: OpenAI routes for what the pipeline serves, plus health and metrics.

Used by ``omnimodel gateway`` (stages reached over HTTP) and ``omnimodel serve`` (stages in process);
the routes cannot tell the difference.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Mapping
from contextlib import asynccontextmanager
from typing import Any, Final, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from omnimodel_runtime.errors import StageError
from omnimodel_runtime.metrics import PROMETHEUS_CONTENT_TYPE, GatewayMetrics, render
from omnimodel_runtime.pipeline import Pipeline, Route
from omnimodel_runtime.protocol.images import ImageChatCompletionRequest, ImageGenerationRequest
from omnimodel_runtime.protocol.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from omnimodel_runtime.protocol.speech import SpeechRequest, VoiceList
from omnimodel_runtime.serving.chat_audio import ChatAudioService, wants_audio
from omnimodel_runtime.serving.errors import APIError, envelope, error_body
from omnimodel_runtime.serving.images import ImageService, answers_chat_with_images
from omnimodel_runtime.serving.orchestrator import Orchestrator
from omnimodel_runtime.serving.speech import SpeechService
from omnimodel_runtime.serving.text import ChatService, CompletionService
from omnimodel_runtime.settings import RuntimeSettings
from omnimodel_runtime.stage.handle import StageHandle
from omnimodel_runtime.web import BodyLimitMiddleware, Startup, StreamResponse

log = logging.getLogger(__name__)

T = TypeVar("T")

CHAT_PATH: Final = "/v1/chat/completions"
COMPLETIONS_PATH: Final = "/v1/completions"
MODELS_PATH: Final = "/v1/models"
SPEECH_PATH: Final = "/v1/audio/speech"
IMAGES_PATH: Final = "/v1/images/generations"
VOICES_PATH: Final = "/v1/audio/voices"
SSE_HEADERS: Final = {"cache-control": "no-cache", "x-accel-buffering": "no"}


class ClientGoneError(Exception):
    """The client disconnected before its (non-streamed) response was ready."""


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client disconnects first; then cancel it (aborting the generation)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.create_task(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        for t in (task, watcher):
            t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
        raise
    watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientGoneError
    return task.result()


class _RequestMetrics:
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


def _validation_message(err: RequestValidationError) -> tuple[str, str | None]:
    errors = err.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".rstrip(": "), None
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    message = first.get("msg", "invalid value")
    if first.get("type") == "missing" and not loc:
        message = "the request body is missing"
    return (f"{param}: {message}" if param else message), param


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
    chat = ChatService(orchestrator, request_timeout=settings.request_timeout)
    chat_audio = ChatAudioService(chat)
    completions = CompletionService(orchestrator, request_timeout=settings.request_timeout)
    startup = Startup()

    async def start() -> None:
        await asyncio.gather(*(h.start() for h in handles.values()))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        startup.begin(start)
        try:
            yield
        finally:
            await startup.cancel()
            await asyncio.gather(*(h.stop() for h in handles.values()), return_exceptions=True)

    app = FastAPI(title=f"OmniModel {pipeline.name}", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.startup = startup
    app.state.orchestrator = orchestrator
    served_paths = {MODELS_PATH}
    if Route.CHAT in pipeline.routes:
        served_paths.add(CHAT_PATH)
    if Route.COMPLETIONS in pipeline.routes:
        served_paths.add(COMPLETIONS_PATH)
    if Route.SPEECH in pipeline.routes:
        served_paths.add(SPEECH_PATH)
    if Route.IMAGES in pipeline.routes:
        served_paths.add(IMAGES_PATH)
    # Added last = outermost: requests refused for size are counted too.
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=settings.max_body_bytes,
        error_body=lambda status, msg: bytes(JSONResponse(envelope(msg, status=status, code=status)).body),
    )
    app.add_middleware(_RequestMetrics, metrics=metrics, routes=frozenset(served_paths))

    # ------------------------------------------------------------ errors as OpenAI envelopes

    @app.exception_handler(StageError)
    async def on_stage_error(_: Request, err: StageError) -> JSONResponse:
        if err.status >= 500:
            log.warning("Request failed: %s", err.message)
        return JSONResponse(error_body(err), status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, err: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(err)
        return JSONResponse(envelope(message, status=400, param=param, code=400), status_code=400)

    @app.exception_handler(HTTPException)
    async def on_http_error(_: Request, err: HTTPException) -> JSONResponse:
        message = str(err.detail) if err.detail else "error"
        return JSONResponse(
            envelope(message, status=err.status_code, code=err.status_code),
            status_code=err.status_code,
            headers=getattr(err, "headers", None),
        )

    @app.exception_handler(ClientGoneError)
    async def on_client_gone(_: Request, __: ClientGoneError) -> Response:
        # Nobody reads this; 499 (nginx's "client closed request") keeps logs and metrics honest.
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def on_unexpected(_: Request, err: Exception) -> JSONResponse:
        log.exception("Unhandled error")
        return JSONResponse(envelope(f"internal error: {type(err).__name__}", status=500, code=500), status_code=500)

    # ------------------------------------------------------------ auth

    api_key = settings.api_key.get_secret_value() if settings.api_key else None

    async def require_key(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError("invalid or missing API key", status=401, code="invalid_api_key")

    guarded = [Depends(require_key)]

    # ------------------------------------------------------------ probes and metrics

    @app.get("/livez")
    async def livez() -> JSONResponse:
        if startup.failed.is_set():
            return JSONResponse(startup.describe(), status_code=503)
        return JSONResponse({"status": "alive"})

    @app.get("/health")
    async def health() -> JSONResponse:
        ready = startup.ready and orchestrator.ready
        for name, handle in handles.items():
            metrics.stage_up(name, handle.ready)
        body = {
            **startup.describe(),
            "status": "ok" if ready else ("unavailable" if startup.ready else startup.phase.value),
            "stages": orchestrator.describe(),
        }
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(render(registry), media_type=PROMETHEUS_CONTENT_TYPE)

    # ------------------------------------------------------------ OpenAI routes

    @app.get(MODELS_PATH, dependencies=guarded)
    async def list_models() -> ModelList:
        max_len = handles[pipeline.entry.name].max_model_len
        return ModelList(data=[ModelCard(id=pipeline.model.name, max_model_len=max_len)])

    def respond(result: Any) -> Response:
        if isinstance(result, AsyncIterator):
            return StreamResponse(result, media_type="text/event-stream", headers=SSE_HEADERS)
        return JSONResponse(result.model_dump(mode="json"))

    images = ImageService(orchestrator, request_timeout=settings.request_timeout)
    if Route.CHAT in pipeline.routes and answers_chat_with_images(pipeline):

        @app.post(CHAT_PATH, dependencies=guarded)
        async def image_chat_completions(body: ImageChatCompletionRequest, request: Request) -> Response:
            return respond(await until_disconnect(request, images.chat(body)))

    elif Route.CHAT in pipeline.routes:

        @app.post(CHAT_PATH, dependencies=guarded)
        async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
            # Audio runs the whole stage chain; everything else stays on the single-stage text path.
            service = chat_audio if wants_audio(body) else chat
            return respond(await until_disconnect(request, service.create(body)))

    if Route.COMPLETIONS in pipeline.routes:

        @app.post(COMPLETIONS_PATH, dependencies=guarded)
        async def text_completions(body: CompletionRequest, request: Request) -> Response:
            return respond(await until_disconnect(request, completions.create(body)))

    if Route.IMAGES in pipeline.routes:

        @app.post(IMAGES_PATH, dependencies=guarded)
        async def image_generations(body: ImageGenerationRequest, request: Request) -> Response:
            return respond(await until_disconnect(request, images.create(body)))

    if Route.SPEECH in pipeline.routes:
        speech = SpeechService(orchestrator, request_timeout=settings.request_timeout)

        @app.post(SPEECH_PATH, dependencies=guarded)
        async def audio_speech(body: SpeechRequest, request: Request) -> Response:
            audio = await until_disconnect(request, speech.create(body))
            if audio.stream is not None:
                return StreamResponse(audio.stream, media_type=audio.media_type, headers=audio.headers)
            return Response(audio.body, media_type=audio.media_type, headers=audio.headers)

        @app.get(VOICES_PATH, dependencies=guarded)
        async def audio_voices() -> VoiceList:
            return await speech.voices()

    return app
