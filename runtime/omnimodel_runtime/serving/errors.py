"""Errors as OpenAI envelopes: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from omnimodel_runtime.errors import StageError, default_error_type
from omnimodel_runtime.protocol.openai import ErrorInfo, ErrorResponse


class APIError(StageError):
    """A request the gateway refuses itself (bad input, unknown model, unsupported option)."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message, status=status, type=type, param=param)
        self.code = code


def envelope(
    message: str, *, status: int, type: str | None = None, param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    """The error body for ``status``."""
    info = ErrorInfo(message=message, type=type or default_error_type(status), param=param, code=code)
    return ErrorResponse(error=info).model_dump()


def error_body(err: StageError) -> dict[str, Any]:
    """The envelope of a ``StageError`` (the HTTP status is the code when no specific code is set)."""
    code = err.code if isinstance(err, APIError) and err.code is not None else err.status
    return envelope(err.message, status=err.status, type=err.type, param=err.param, code=code)


def invalid(err: ValidationError) -> APIError:
    """A 400 naming the first invalid field of a body validated by hand (a form, not FastAPI's body)."""
    first = err.errors()[0]
    param = ".".join(str(p) for p in first["loc"]) or None
    return APIError(f"{param}: {first['msg']}" if param else first["msg"], param=param)
