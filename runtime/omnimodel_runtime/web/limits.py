"""Request bodies over a size limit are refused before the app has buffered them."""

from __future__ import annotations

import json
from collections.abc import Callable

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send


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
