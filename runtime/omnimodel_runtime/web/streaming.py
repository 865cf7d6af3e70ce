"""A streamed HTTP response that stops its producer the moment the client disconnects."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

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
