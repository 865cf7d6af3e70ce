"""The optional API key: ``Authorization: Bearer <key>`` on every OpenAI route when one is configured."""

from __future__ import annotations

import hmac

from fastapi import Request

from omnimodel_runtime.api.state import api_state
from omnimodel_runtime.serving.errors import APIError


async def require_key(request: Request) -> None:
    """A 401 unless the request carries the gateway's key (compared in constant time)."""
    api_key = api_state(request).api_key
    if api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise APIError("invalid or missing API key", status=401, code="invalid_api_key")
