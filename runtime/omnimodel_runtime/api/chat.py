"""``POST /v1/chat/completions``: text (and, with ``modalities`` holding audio, speech too) from a chat
pipeline, or images from an image pipeline (:data:`image_router`); the gateway mounts the one its
pipeline answers with."""

from __future__ import annotations

from typing import Annotated, Final

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from omnimodel_runtime.api.auth import require_key
from omnimodel_runtime.api.openapi import SSE, STAGE_ERRORS, errors, ok
from omnimodel_runtime.api.responses import respond, until_disconnect
from omnimodel_runtime.api.state import APIState, api_state
from omnimodel_runtime.protocol.images import ImageChatCompletionRequest, ImageChatCompletionResponse
from omnimodel_runtime.protocol.openai import ChatCompletionRequest, ChatCompletionResponse
from omnimodel_runtime.serving.chat_audio import wants_audio, with_default_modalities

PATH: Final = "/v1/chat/completions"

router = APIRouter(dependencies=[Depends(require_key)])
image_router = APIRouter(dependencies=[Depends(require_key)])


@router.post(
    PATH,
    response_model=ChatCompletionResponse,
    responses=ok("The answer; with `stream: true` as server-sent events", SSE) | errors(*STAGE_ERRORS),
)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, api: Annotated[APIState, Depends(api_state)]
) -> Response:
    body = with_default_modalities(body, api.chat_modalities)
    # Audio runs the chain down to the vocoder; text-only chat stops at the stage that writes the text.
    service = api.chat_audio if wants_audio(body) else api.chat
    return respond(await until_disconnect(request, service.create(body)))


@image_router.post(
    PATH,
    response_model=ImageChatCompletionResponse,
    responses=ok("The images as `image_url` data-URL content parts") | errors(*STAGE_ERRORS),
)
async def image_chat_completions(
    body: ImageChatCompletionRequest, request: Request, api: Annotated[APIState, Depends(api_state)]
) -> Response:
    return respond(await until_disconnect(request, api.images.chat(body)))
