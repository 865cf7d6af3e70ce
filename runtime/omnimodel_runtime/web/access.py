"""One access log line per HTTP request, a request id that follows it, and JSON logs when asked.

Every request gets an id: the caller's ``X-Request-ID`` when it sends a usable one, else a new one. It is
echoed in the response's ``X-Request-ID``, logged on the access line, available to the code serving the
request (:func:`current_request_id`: the gateway names its stage requests with it, and sends it to the
stages in the same header), so one id ties a client's request to every line it caused.

The line is written when the response is complete (streams included, so the latency is the whole
answer), to the ``omnimodel_runtime.access`` logger: ``POST /v1/chat/completions 200 41.2 ms id=…``; with
``OMNIMODEL_LOG_FORMAT=json`` every log line is a JSON object and the access line carries ``method``,
``path``, ``status``, ``latency_ms`` and ``request_id`` as fields of its own.
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import secrets
import time
from typing import Any, Final

from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID_HEADER: Final = "x-request-id"
_USABLE_ID: Final = re.compile(r"[A-Za-z0-9._:\-]{1,128}")

access_log = logging.getLogger("omnimodel_runtime.access")

_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("omnimodel_request_id", default=None)


def current_request_id() -> str | None:
    """The id of the HTTP request being served in this context (``None`` outside of one)."""
    return _request_id.get()


def new_request_id() -> str:
    return secrets.token_hex(16)


class AccessLogMiddleware:
    """Outermost middleware of a server: assigns the request id and logs the access line."""

    def __init__(self, app: ASGIApp, *, quiet_paths: frozenset[str] = frozenset()) -> None:
        self.app = app
        # Probes polled every second (/health, /livez, /metrics) log at debug only (a 503 /health while
        # loading is the expected answer; what a stage is waiting for is in its own log lines).
        self.quiet_paths = quiet_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or []).get(REQUEST_ID_HEADER.encode(), b"").decode("latin-1")
        request_id = given if _USABLE_ID.fullmatch(given) else new_request_id()
        token = _request_id.set(request_id)
        started, status = time.perf_counter(), 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            _request_id.reset(token)
            latency_ms = (time.perf_counter() - started) * 1000
            path = scope.get("path", "")
            level = logging.DEBUG if path in self.quiet_paths else logging.INFO
            fields = {
                "method": scope.get("method", ""),
                "path": path,
                "status": status,
                "latency_ms": round(latency_ms, 1),
                "request_id": request_id,
            }
            access_log.log(
                level, "%s %s %d %.1f ms id=%s", fields["method"], path, status, latency_ms, request_id, extra=fields
            )


_STANDARD: Final = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JSONFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, the record's extra fields, the traceback."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        out.update({k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")})
        if record.exc_info:
            out["traceback"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


JSONFormatter.converter = time.gmtime
