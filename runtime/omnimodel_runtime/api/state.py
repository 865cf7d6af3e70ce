"""What the routes reach through the app: the services of this gateway and its API key."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from fastapi import Request

from omnimodel_runtime.pipeline import Pipeline
from omnimodel_runtime.serving.chat_audio import ChatAudioService, default_modalities
from omnimodel_runtime.serving.images import ImageService
from omnimodel_runtime.serving.media import NO_FETCH, MediaPolicy
from omnimodel_runtime.serving.orchestrator import Orchestrator
from omnimodel_runtime.serving.speech import SpeechService
from omnimodel_runtime.serving.text import ChatService, CompletionService
from omnimodel_runtime.serving.videos import VideoService


@dataclass(frozen=True)
class APIState:
    """One gateway's services, built by :func:`~omnimodel_runtime.gateway.app.build_app` and kept on
    ``app.state.api``; routes get it through the :func:`api_state` dependency."""

    pipeline: Pipeline
    orchestrator: Orchestrator
    chat: ChatService
    chat_audio: ChatAudioService
    completions: CompletionService
    images: ImageService
    speech: SpeechService
    videos: VideoService
    # Clients must send ``Authorization: Bearer <key>`` when set.
    api_key: str | None
    # What chat answers with when a request names no ``modalities``.
    chat_modalities: tuple[Literal["text", "audio"], ...] = ("text",)

    @classmethod
    def create(
        cls,
        orchestrator: Orchestrator,
        *,
        request_timeout: float,
        api_key: str | None,
        chat_modalities: Sequence[str] = ("text",),
        media: MediaPolicy = NO_FETCH,
    ) -> APIState:
        return cls(
            pipeline=orchestrator.pipeline,
            orchestrator=orchestrator,
            chat=ChatService(orchestrator, request_timeout=request_timeout, media=media),
            chat_audio=ChatAudioService(orchestrator, request_timeout=request_timeout, media=media),
            completions=CompletionService(orchestrator, request_timeout=request_timeout),
            images=ImageService(orchestrator, request_timeout=request_timeout, media=media),
            speech=SpeechService(orchestrator, request_timeout=request_timeout),
            videos=VideoService(orchestrator, request_timeout=request_timeout),
            api_key=api_key,
            chat_modalities=default_modalities(chat_modalities, orchestrator.pipeline),
        )


def api_state(request: Request) -> APIState:
    """The dependency that hands a route its gateway's services."""
    state: APIState = request.app.state.api
    return state
