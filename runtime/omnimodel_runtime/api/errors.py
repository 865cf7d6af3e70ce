"""Every error a gateway answers, as the OpenAI envelope ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from omnimodel_runtime.api.responses import ClientGoneError
from omnimodel_runtime.errors import StageError
from omnimodel_runtime.serving.errors import envelope, error_body

log = logging.getLogger(__name__)


def install_error_handlers(app: FastAPI) -> None:
    """Answer stage errors, bad requests, HTTP errors and surprises with the OpenAI envelope."""

    @app.exception_handler(StageError)
    async def on_stage_error(_: Request, err: StageError) -> JSONResponse:
        if err.status >= 500:
            log.warning("Request failed: %s", err.message)
        return JSONResponse(error_body(err), status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, err: RequestValidationError) -> JSONResponse:
        message, param = validation_message(err)
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


def validation_message(err: RequestValidationError) -> tuple[str, str | None]:
    """The message and the offending field (``messages.0.content``) of a request that failed validation."""
    errors = err.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".rstrip(": "), None
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # A check of the whole body (the extra_body merge) names its field in its context.
    param = ".".join(loc) or first.get("ctx", {}).get("param") or None
    message = first.get("msg", "invalid value")
    if first.get("type") == "missing" and not loc:
        message = "the request body is missing"
    return (f"{param}: {message}" if param else message), param


def body_too_large(status: int, message: str) -> bytes:
    """The envelope the body-size limit answers with (it runs before the app, so it cannot raise)."""
    return bytes(JSONResponse(envelope(message, status=status, code=status)).body)
