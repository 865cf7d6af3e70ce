"""What ``/openapi.json`` says about the routes, kept true to what they answer.

FastAPI documents a route by its body model and its return annotation; ours return ``Response`` objects
(JSON, SSE or audio) and answer errors through our own handlers, so left alone the document would say
"200: anything" and "422: validation error" (a status this server never sends: validation errors are
400 in the OpenAI envelope). Routes declare here what they really send, and :func:`install_openapi`
removes what FastAPI adds on its own. Generated clients and schema fuzzers (tests/component/runtime/
test_fuzz_openapi.py) read this document, so every status and content type a route can answer is in it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Final

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from omnimodel_runtime.protocol.openai import ErrorResponse

# Why each error status happens; a route lists the ones it can answer.
_WHY: Final = {
    400: "The request is malformed or asks for something this model cannot do; `error.param` names the field.",
    401: "An API key is configured and the request does not carry it (`Authorization: Bearer <key>`).",
    404: "The request names another model than the one served (`error.param` is `model`), or an unknown id.",
    409: "The video job is not completed yet (queued, in progress or failed): it has no content to download.",
    413: "The request body is larger than the server accepts (`OMNIMODEL_MAX_BODY_BYTES`).",
    429: "Every video job this gateway keeps is still queued or running; retry later or delete one.",
    500: "An unexpected failure in the gateway or a stage.",
    501: "The model cannot answer this (e.g. it has no list of voices).",
    502: "A stage answered with something unusable or the connection to it was lost mid-request.",
    503: "A stage the request needs is unavailable (no healthy endpoint, still warming up, shutting down).",
    504: "A stage sent nothing for its read timeout, or the request ran past its deadline.",
}

# Statuses every route that runs stages can answer; routes add their own.
STAGE_ERRORS: Final = (400, 401, 404, 413, 500, 502, 503, 504)

# One server-sent event: ``data`` is a chunk as JSON text (or ``[DONE]``, the last one).
SSE: Final = {
    "text/event-stream": {
        "schema": {
            "type": "object",
            "description": "One server-sent event: `data` holds a JSON chunk, then `[DONE]`",
            "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
            "required": ["data"],
        }
    }
}

Responses = dict[int | str, dict[str, Any]]


def ok(description: str, content: dict[str, Any] | None = None) -> Responses:
    """A 200 with ``description``; ``content`` adds media types beside the route's response model."""
    return {200: {"description": description, **({"content": content} if content else {})}}


def errors(*statuses: int) -> Responses:
    """``responses=`` entries for ``statuses``, each with the OpenAI error envelope as its body."""
    return {s: {"model": ErrorResponse, "description": _WHY[s]} for s in statuses}


def binary(media_types: Iterable[str], description: str) -> Responses:
    """A 200 whose body is bytes in one of ``media_types``."""
    return ok(description, {m: {"schema": {"type": "string", "format": "binary"}} for m in media_types})


def probe(description: str, *statuses: int) -> Responses:
    """The JSON probes (``/livez``, ``/health``): an object with a ``status`` string, more details beside."""
    schema = {
        "type": "object",
        "properties": {"status": {"type": "string"}},
        "required": ["status"],
        "additionalProperties": True,
    }
    return {s: {"description": description, "content": {"application/json": {"schema": schema}}} for s in statuses}


def form_schema(
    model: type[BaseModel], *, files: Mapping[str, dict[str, Any]], required: Iterable[str]
) -> dict[str, Any]:
    """The ``multipart/form-data`` schema of a form whose text fields are ``model``'s and whose files are
    ``files``: each field as the one type it takes (a form cannot send null; a field that accepts only
    null is left out, since it can only be omitted), inline, with the files as binary strings."""
    properties: dict[str, Any] = {}
    for name, prop in model.model_json_schema()["properties"].items():
        options = [o for o in prop.get("anyOf", [prop]) if o.get("type") != "null"]
        if not options:
            continue
        rest = {k: v for k, v in prop.items() if k not in ("anyOf", "type", "default", "title")}
        properties[name] = {**rest, **options[0]} if len(options) == 1 else {**rest, "anyOf": options}
    return {"type": "object", "properties": {**properties, **files}, "required": list(required)}


def install_openapi(app: FastAPI) -> None:
    """Serve ``/openapi.json`` without the 422 responses and validation schemas FastAPI adds by itself."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for operations in doc.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            schemas = doc.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
