"""``POST /v1/completions``: legacy text completions."""

from __future__ import annotations

from typing import Annotated, Final

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from omnimodel_runtime.api.auth import require_key
from omnimodel_runtime.api.openapi import SSE, STAGE_ERRORS, errors, ok
from omnimodel_runtime.api.responses import respond, until_disconnect
from omnimodel_runtime.api.state import APIState, api_state
from omnimodel_runtime.protocol.openai import CompletionRequest, CompletionResponse

PATH: Final = "/v1/completions"

router = APIRouter(dependencies=[Depends(require_key)])


@router.post(
    PATH,
    response_model=CompletionResponse,
    responses=ok("The completion; with `stream: true` as server-sent events", SSE) | errors(*STAGE_ERRORS),
)
async def text_completions(
    body: CompletionRequest, request: Request, api: Annotated[APIState, Depends(api_state)]
) -> Response:
    return respond(await until_disconnect(request, api.completions.create(body)))
