"""The internal stage protocol: what a gateway (or an upstream stage) sends a stage, and what comes back.

A request is a :class:`StageRequest` header plus optional named tensors; a response is a stream of
frames: :class:`TextFrame` (a text delta with its token ids), :class:`TensorFrame` (named arrays),
then exactly one :class:`FinalFrame` or :class:`ErrorFrame`. Tensors are numpy arrays here; torch
lives only inside engines. In ``serve`` mode these objects pass between stages in memory; across
processes :mod:`omnimodel_runtime.protocol.frames` encodes them, sent to :data:`GENERATE_PATH`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Final, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from omnimodel_runtime.errors import StageError
from omnimodel_runtime.pipeline import Modality
from omnimodel_runtime.protocol.images import ImageEditParams, TextToImageParams
from omnimodel_runtime.protocol.openai import Seed, TokenId
from omnimodel_runtime.protocol.videos import TextToVideoParams

# Where a stage server takes requests (``POST``, frames in, frames out).
GENERATE_PATH: Final = "/v1/stage/generate"
# Where a stage server describes itself (``GET``, a :class:`StageInfo`).
INFO_PATH: Final = "/v1/stage/info"
# ``StageParams.query`` asking a speech engine for its voices instead of speech; the stage asks its own
# engine and answers the gateway with :class:`StageInfo` (``voices``).
QUERY_VOICES: Final = "voices"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StageVoices(_Model):
    """The speaker names a stage's model ships, and the one used when a request names none."""

    names: tuple[str, ...]
    default: str


class StageInfo(_Model):
    """``GET /v1/stage/info``: what a stage serves. ``max_model_len`` and ``voices`` are known once the
    engine is ready; ``voices`` only on the stage that reads a speech request's text (None when its
    model ships no voices)."""

    stage: str
    engine: str
    task: str
    model: str
    # The start-up phase (``web.startup.Phase``) and, after a failed start, why.
    status: str
    error: str | None = None
    max_model_len: int | None = None
    voices: StageVoices | None = None


class SamplingParams(_Model):
    """Per-request sampling. ``None`` means the model's own default (its generation_config)."""

    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    seed: Seed | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False


class StageParams(_Model):
    """What a request asks of a stage beyond its input and sampling. Each field says which tasks read it;
    the defaults mean "not asked" (the stage's own default). Values whose limits depend on the model (a
    voice, a speed, an image size) are checked by the stage that reads them, with a 400 naming the field.
    """

    # Any entry stage of a speech pipeline: a question about the engine (its voices) instead of work.
    query: Literal["voices"] | None = None
    # omni-thinker: the output modalities the client asked for; with audio in them the thinker also
    # streams the rows its talker needs.
    modalities: tuple[Modality, ...] = ()
    # Speech (tts-acoustic, the omni stages): the voice; None is the model's default voice.
    voice: str | None = None
    # Speech: how much faster than normal to speak (2.0 = twice as fast), pitch unchanged.
    speed: float = 1.0
    # omni-thinker on ``/v1/audio/speech``: say ``prompt`` verbatim instead of answering it.
    speak: bool = False
    # omni-code2wav: chunked (streaming) synthesis; None follows ``StageRequest.stream``.
    audio_chunked: bool | None = None
    # omni-thinker: token ids to teacher-force as the reply (after the prompt) instead of sampling one.
    reply_ids: tuple[TokenId, ...] | None = None
    # omni-talker (warm-up, benchmarks): a lower cap on this request's codes.
    talker_max_new_tokens: Annotated[int, Field(ge=1)] | None = None
    # Text to image (text-to-image, t2i-encode, t2i-denoise, t2i-decode): size, steps, guidance, seed.
    image: TextToImageParams = TextToImageParams()
    # Image edits (image-edit and its split tasks): the input image's size; its bytes are ``media[0]``.
    edit: ImageEditParams | None = None
    # Text to video (text-to-video): size, length, frame rate, steps, guidance, seed, output form.
    video: TextToVideoParams | None = None


class MediaInput(_Model):
    """An audio, image or video part of the chat ``messages``, in the order the parts appear there (the
    messages keep a ``{"type": "audio"}`` / ``{"type": "image"}`` / ``{"type": "video"}`` placeholder part
    in its place). Its bytes, still encoded (a WAV/MP3/FLAC file, a PNG/JPEG/... image, an MP4/WebM/...
    video), are the request tensor named ``tensor`` (uint8): in process as they are, across processes in
    the request frame."""

    kind: Literal["audio", "image", "video"]
    tensor: Annotated[str, Field(min_length=1)]
    # audio: wav, mp3 or flac; image and video: the MIME type as the client gave it (the bytes decide).
    format: str
    # Where the client put it (``messages[0].content[1]``): the ``param`` of an error about it.
    param: str
    # video: how many frames to take (None: the model's rate, 2 a second).
    num_frames: Annotated[int, Field(ge=1)] | None = None
    # video: its audio track goes in too, interleaved with the frames (``use_audio_in_video``).
    use_audio: bool = False


class StageRequest(_Model):
    """The header of a stage request. Exactly one of ``messages``/``prompt``/``prompt_token_ids`` is
    the input of a ``text-generation`` stage; later tasks read their inputs from ``params`` and tensors.
    """

    request_id: Annotated[str, Field(min_length=1, max_length=256)]
    messages: tuple[Mapping[str, Any], ...] | None = None
    prompt: str | None = None
    prompt_token_ids: tuple[TokenId, ...] | None = None
    # The audio and image parts of ``messages`` (only entry stages that take them get any).
    media: tuple[MediaInput, ...] = ()
    sampling: SamplingParams = SamplingParams()
    # Absolute wall-clock time (Unix seconds) after which the stage abandons the request.
    deadline: float | None = None
    # False when nobody downstream reads partial output (a non-streamed API request): the stage may
    # then send its text in one frame at the end instead of one frame per token, sparing a frame,
    # an event-loop wake-up and an HTTP chunk per token (vLLM's FINAL_ONLY output kind).
    stream: bool = True
    # Task-specific parameters for presets beyond text (voice, image size, steps, ...).
    params: StageParams = StageParams()


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True, slots=True)
class RequestFrame:
    """First frame of a request body: the header and any tensors that come with it."""

    request: StageRequest
    tensors: Mapping[str, np.ndarray] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TextFrame:
    """Newly generated text and the token ids behind it (``text`` may be empty while a multi-byte
    character is incomplete)."""

    text: str
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class TensorFrame:
    """Named arrays plus small JSON metadata (e.g. which rows of a streamed hand-off these are)."""

    tensors: Mapping[str, np.ndarray]
    meta: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class FinalFrame:
    """The request is complete."""

    finish_reason: str
    usage: Usage = Usage()


@dataclass(frozen=True, slots=True)
class ErrorFrame:
    """The request failed; ``status`` is the HTTP status the client should eventually see."""

    message: str
    status: int = 500
    type: str = "server_error"
    param: str | None = None

    def to_error(self) -> StageError:
        return StageError(self.message, status=self.status, type=self.type, param=self.param)

    @classmethod
    def from_error(cls, err: StageError) -> ErrorFrame:
        return cls(message=err.message, status=err.status, type=err.type, param=err.param)


# Frames a stage sends back.
ResponseFrame = TextFrame | TensorFrame | FinalFrame | ErrorFrame


@dataclass(frozen=True)
class StageInput:
    """One request as a stage sees it: the header, tensors sent with it, and, for a downstream stage, the
    frames of its upstream stage as they arrive (``None`` when it has no upstream). In process these pass
    as they are; across processes the stage server rebuilds them from frames."""

    request: StageRequest
    tensors: Mapping[str, np.ndarray] = field(default_factory=dict)
    upstream: AsyncIterator[ResponseFrame] | None = None


# Anything that travels in a frame stream (a request body starts with a RequestFrame and may continue
# with response frames of an upstream stage).
Frame = RequestFrame | ResponseFrame
