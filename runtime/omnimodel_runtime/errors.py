"""Exceptions shared by every layer of the runtime (no heavy imports here)."""

from __future__ import annotations


class RuntimeSetupError(RuntimeError):
    """The process cannot start as configured (bad pipeline, stage, model source, missing extra)."""


class ExtraMissingError(RuntimeSetupError):
    """An optional dependency is not installed; the message names the pip extra that provides it."""

    def __init__(self, *, what: str, extra: str, cause: BaseException | None = None) -> None:
        detail = f" ({cause})" if cause is not None else ""
        super().__init__(f"{what} needs the '{extra}' extra: pip install 'omnimodel[{extra}]'{detail}")
        self.extra = extra


class ModelSourceError(RuntimeSetupError):
    """A model source that cannot be resolved to a local directory."""


class StageError(Exception):
    """A request failed inside (or on the way to) a stage; carries the HTTP status a client should see.

    Engines raise it for bad input (``status=400``); the stage protocol carries it as an error frame;
    the gateway turns it into the OpenAI error envelope.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int = 500,
        type: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type or default_error_type(status)
        self.param = param


class StageUnavailableError(StageError):
    """No endpoint of a stage could take the request (all down, refusing, or still warming up)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, status=503, type="service_unavailable")


def default_error_type(status: int) -> str:
    """OpenAI's error ``type`` for an HTTP status."""
    if status in (401, 403):
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    if 400 <= status < 500:
        return "invalid_request_error"
    if status == 503:
        return "service_unavailable"
    return "server_error"
