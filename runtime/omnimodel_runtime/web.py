"""HTTP plumbing shared by the stage server and the gateway (ASGI level, no routes)."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from omnimodel_runtime.errors import RuntimeSetupError

log = logging.getLogger(__name__)


class StreamResponse(Response):
    """Streams an async iterator of bytes and cancels it as soon as the client disconnects.

    Starlette's ``StreamingResponse`` under ASGI 2.4 servers (uvicorn) notices a disconnect only when
    the next chunk fails to send; a generation waiting in a queue or between slow steps would keep
    running for nobody. Here a watcher awaits ``http.disconnect`` concurrently and cancels the stream,
    which throws ``CancelledError`` into the producing generator, whose cleanup aborts the engine request.

    ``drain_body`` (optional) consumes the rest of the request body first: a request body that is
    itself a stream (frames from an upstream stage) shares ``receive`` with the watcher, so the watcher
    reads it to the end before listening for the disconnect.
    """

    def __init__(
        self,
        content: AsyncIterator[bytes],
        *,
        media_type: str,
        status_code: int = 200,
        headers: Mapping[str, str] | None = None,
        drain_body: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.body_iterator = content
        self.status_code = status_code
        self.media_type = media_type
        self.background = None
        self._drain_body = drain_body
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def pump() -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def watch() -> None:
            if self._drain_body is not None:
                await self._drain_body()
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return

        pump_task = asyncio.create_task(pump())
        watch_task = asyncio.create_task(watch())
        try:
            await asyncio.wait({pump_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (pump_task, watch_task):
                task.cancel()
            await asyncio.gather(pump_task, watch_task, return_exceptions=True)
            # The generator may be parked at a ``yield`` (cancelled while sending): close it so its
            # cleanup runs now rather than at garbage collection.
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
        if not pump_task.cancelled() and (err := pump_task.exception()) is not None and not isinstance(err, OSError):
            log.error("Streaming a response failed", exc_info=err)


class BodyTooLargeError(HTTPException):
    """Raised from ``receive`` when a body exceeds the limit (an ``HTTPException`` so that FastAPI's body
    parsing passes it through as a 413 instead of wrapping it into a 400)."""

    def __init__(self, limit: int) -> None:
        super().__init__(status_code=413, detail=f"request body exceeds the limit of {limit} bytes")


class BodyLimitMiddleware:
    """Refuses bodies over ``max_bytes``: at once when Content-Length says so, otherwise as soon as the
    running total passes the limit (chunked uploads), before the app has buffered it all."""

    def __init__(self, app: ASGIApp, *, max_bytes: int, error_body: Callable[[int, str], bytes] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.error_body = error_body or (lambda status, message: json.dumps({"detail": message}).encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._reject(send)
            return
        total = 0

        async def limited() -> Message:
            nonlocal total
            message = await receive()
            if message["type"] == "http.request":
                total += len(message.get("body", b""))
                if total > self.max_bytes:
                    raise BodyTooLargeError(self.max_bytes)
            return message

        await self.app(scope, limited, send)

    async def _reject(self, send: Send) -> None:
        body = self.error_body(413, f"request body exceeds the limit of {self.max_bytes} bytes")
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})


class Phase(enum.StrEnum):
    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"
    STOPPING = "stopping"


class Startup:
    """Runs a slow start (loading an engine, reaching stages) in the background so the server answers
    ``/livez`` and a 503 ``/health`` meanwhile; ``failed`` lets the process runner exit on failure."""

    def __init__(self) -> None:
        self.phase = Phase.STARTING
        self.error: str | None = None
        self.failed = asyncio.Event()
        self.settled = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def begin(self, start: Callable[[], Awaitable[None]]) -> None:
        async def run() -> None:
            try:
                await start()
            except asyncio.CancelledError:
                raise
            except Exception as err:
                log.exception("Start-up failed")
                self.phase, self.error = Phase.FAILED, f"{type(err).__name__}: {err}"
                self.failed.set()
            else:
                if self.phase is Phase.STARTING:
                    self.phase = Phase.READY
            finally:
                self.settled.set()

        self._task = asyncio.create_task(run())

    async def cancel(self) -> None:
        self.phase = Phase.STOPPING
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def wait(self) -> None:
        """Until start-up finished; raises ``RuntimeSetupError`` when it failed."""
        await self.settled.wait()
        if self.phase is Phase.FAILED:
            raise RuntimeSetupError(self.error or "start-up failed")

    @property
    def ready(self) -> bool:
        return self.phase is Phase.READY

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"status": self.phase.value}
        if self.error:
            out["error"] = self.error
        return out
