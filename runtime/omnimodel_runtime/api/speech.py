"""``POST /v1/audio/speech`` (an audio file, or raw PCM as it is synthesised) and ``GET /v1/audio/voices``."""

from __future__ import annotations

from typing import Annotated, Final

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from omnimodel_runtime.api.auth import require_key
from omnimodel_runtime.api.openapi import STAGE_ERRORS, binary, errors
from omnimodel_runtime.api.responses import until_disconnect
from omnimodel_runtime.api.state import APIState, api_state
from omnimodel_runtime.protocol.speech import SpeechRequest, VoiceList
from omnimodel_runtime.serving.audio import MEDIA_TYPES
from omnimodel_runtime.web.streaming import StreamResponse

PATH: Final = "/v1/audio/speech"
VOICES_PATH: Final = "/v1/audio/voices"

router = APIRouter(dependencies=[Depends(require_key)])


@router.post(
    PATH,
    response_class=Response,
    responses=binary(
        MEDIA_TYPES.values(),
        "The audio file in `response_format` at the model's rate, or raw 16-bit mono PCM at 24 kHz (`pcm`, and "
        "every stream); X-Sample-Rate states the rate",
    )
    | errors(*STAGE_ERRORS),
)
async def audio_speech(body: SpeechRequest, request: Request, api: Annotated[APIState, Depends(api_state)]) -> Response:
    audio = await until_disconnect(request, api.speech.create(body))
    if audio.stream is not None:
        return StreamResponse(audio.stream, media_type=audio.media_type, headers=audio.headers)
    return Response(audio.body, media_type=audio.media_type, headers=audio.headers)


@router.get(VOICES_PATH, responses=errors(401, 500, 501, 502, 503, 504))
async def audio_voices(api: Annotated[APIState, Depends(api_state)]) -> VoiceList:
    return await api.speech.voices()
