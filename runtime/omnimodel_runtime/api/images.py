"""``POST /v1/images/generations``: PNGs from a text-to-image pipeline."""

from __future__ import annotations

from typing import Annotated, Final

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from omnimodel_runtime.api.auth import require_key
from omnimodel_runtime.api.openapi import SSE, STAGE_ERRORS, errors, ok
from omnimodel_runtime.api.responses import respond, until_disconnect
from omnimodel_runtime.api.state import APIState, api_state
from omnimodel_runtime.protocol.images import ImageGenerationRequest, ImagesResponse

PATH: Final = "/v1/images/generations"

router = APIRouter(dependencies=[Depends(require_key)])


@router.post(
    PATH,
    response_model=ImagesResponse,
    responses=ok(
        "PNG images as base64 (`data[i].b64_json`); with `stream: true` as server-sent "
        "`image_generation.completed` events, one per image",
        SSE,
    )
    | errors(*STAGE_ERRORS),
)
async def image_generations(
    body: ImageGenerationRequest, request: Request, api: Annotated[APIState, Depends(api_state)]
) -> Response:
    return respond(await until_disconnect(request, api.images.create(body)))
