"""Text to video on the wire: OpenAI's (and vLLM-Omni's) asynchronous video jobs, and the stage parameters.

``POST /v1/videos`` creates a job and answers at once with a ``video`` object (``status: queued``); the
client polls ``GET /v1/videos/{id}`` until ``completed`` (or ``failed``, with an ``error``), then fetches
the MP4 from ``GET /v1/videos/{id}/content``. The body comes as JSON or as a multipart form (the ``openai``
client sends a form): every value may arrive as text, so numbers are parsed from it. Beside OpenAI's
``prompt``, ``model``, ``seconds`` and ``size``, the diffusion extensions vLLM-Omni serves: ``num_frames``,
``fps``, ``num_inference_steps``, ``guidance_scale``, ``guidance_scale_2``, ``negative_prompt``, ``seed``.

What depends on the model (Wan: ``4k + 1`` frames, sides a multiple of 16) is checked by the stage, before
the job is accepted, so it is still a 400 naming the field. Torch-free: the gateway imports this module.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from omnimodel_runtime.protocol.images import Guidance, Seed, Steps, parse_size
from omnimodel_runtime.protocol.openai import OpenAIBaseModel, Text

# A minute of video at 16 fps is 961 frames; beyond that one request holds an accelerator for hours.
MAX_FRAMES: Final = 961
MAX_FPS: Final = 60
MAX_SECONDS: Final = 60.0
# Largest side: 1280 is Wan2.2's 720p; twice that is already 4x its pixels per frame.
MAX_VIDEO_SIDE: Final = 2560

# Tensors the text-to-video stage sends: the MP4 file's bytes (uint8, 1-D), or with ``output="frames"``
# the decoded frames, uint8 ``(frames, height, width, 3)``.
VIDEO_TENSOR: Final = "video"
FRAMES_TENSOR: Final = "frames"

VideoStatus = Literal["queued", "in_progress", "completed", "failed"]


class TextToVideoParams(BaseModel):
    """One text-to-video request as the stage receives it (``StageRequest.params.video``). ``None`` is the
    model's own default (its pipeline's ``__call__`` defaults; 16 fps for Wan2.2). ``seconds`` becomes a
    frame count at the stage, which knows the model's frame rule; ``num_frames`` is taken as it is."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    width: Annotated[int, Field(ge=1, le=MAX_VIDEO_SIDE)] | None = None
    height: Annotated[int, Field(ge=1, le=MAX_VIDEO_SIDE)] | None = None
    num_frames: Annotated[int, Field(ge=1, le=MAX_FRAMES)] | None = None
    seconds: Annotated[float, Field(gt=0, le=MAX_SECONDS)] | None = None
    fps: Annotated[int, Field(ge=1, le=MAX_FPS)] | None = None
    num_inference_steps: Steps | None = None
    guidance_scale: Guidance | None = None
    guidance_scale_2: Guidance | None = None
    negative_prompt: Text | None = None
    seed: Seed | None = None
    # mp4: the file the API serves; frames: the raw pixels (tests and benchmarks compare them exactly).
    output: Literal["mp4", "frames"] = "mp4"

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if (self.width is None) != (self.height is None):
            raise PydanticCustomError("video_size", "width and height must be given together")
        if self.seconds is not None and self.num_frames is not None:
            raise PydanticCustomError("video_length", "send seconds or num_frames, not both")
        return self


class VideoCreateRequest(OpenAIBaseModel):
    """``POST /v1/videos`` (JSON or multipart form; lax types, since a form's values are all text)."""

    prompt: Text
    model: str | None = None
    seconds: Annotated[float, Field(gt=0, le=MAX_SECONDS)] | None = None
    size: str | None = None
    num_frames: Annotated[int, Field(ge=1, le=MAX_FRAMES)] | None = None
    fps: Annotated[int, Field(ge=1, le=MAX_FPS)] | None = None
    num_inference_steps: Steps | None = None
    guidance_scale: Guidance | None = None
    guidance_scale_2: Guidance | None = None
    negative_prompt: Text | None = None
    seed: Seed | None = None
    # vLLM-Omni's example clients send the size as width and height form fields.
    width: Annotated[int, Field(ge=1, le=MAX_VIDEO_SIDE)] | None = None
    # Validated even when absent: the check that width and height come together lives on it.
    height: Annotated[int | None, Field(ge=1, le=MAX_VIDEO_SIDE, validate_default=True)] = None
    # vLLM-Omni's fields this server does not serve per request: only their neutral values, anything else
    # a 400 naming the field rather than a setting silently ignored. One video per job; the experts'
    # boundary and the scheduler's shift are the checkpoint's (its model_index and scheduler config).
    n: Literal[1] = 1
    boundary_ratio: None = None
    flow_shift: None = None
    lora: None = None
    # OpenAI's image-to-video reference: a text-to-video model has nothing to do with it.
    input_reference: None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: str) -> str:
        if not value.strip():
            raise PydanticCustomError("empty_prompt", "must not be empty")
        return value

    @field_validator("size")
    @classmethod
    def _size(cls, value: str | None) -> str | None:
        if value is not None:
            width, height = parse_size(value)
            if width > MAX_VIDEO_SIDE or height > MAX_VIDEO_SIDE:
                raise PydanticCustomError(
                    "video_size",
                    "each side must be at most {max} pixels (got {value})",
                    {"max": MAX_VIDEO_SIDE, "value": repr(value)},
                )
        return value

    @field_validator("num_frames")
    @classmethod
    def _one_length(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and info.data.get("seconds") is not None:
            raise PydanticCustomError("video_length", "send seconds or num_frames, not both")
        return value

    @field_validator("height")
    @classmethod
    def _one_size(cls, height: int | None, info: ValidationInfo) -> int | None:
        width, size = info.data.get("width"), info.data.get("size")
        if (width is None) != (height is None):
            raise PydanticCustomError("video_size", "width and height must be given together")
        if size is not None and width is not None and parse_size(size) != (width, height):
            raise PydanticCustomError("video_size", "disagrees with size; send size, or width and height")
        return height

    def params(self) -> TextToVideoParams:
        width, height = parse_size(self.size) if self.size is not None else (self.width, self.height)
        return TextToVideoParams(
            width=width,
            height=height,
            num_frames=self.num_frames,
            seconds=self.seconds,
            fps=self.fps,
            num_inference_steps=self.num_inference_steps,
            guidance_scale=self.guidance_scale,
            guidance_scale_2=self.guidance_scale_2,
            negative_prompt=self.negative_prompt,
            seed=self.seed,
        )


class VideoError(OpenAIBaseModel):
    """Why a job failed (OpenAI's ``VideoCreateError``, plus the ``type`` and ``param`` of our envelopes)."""

    code: str
    message: str
    type: str | None = None
    param: str | None = None


class VideoObject(OpenAIBaseModel):
    """OpenAI's ``video`` object. ``seconds`` is the video's length as text (``"4"``, ``"5.06"``), ``size``
    its ``WIDTHxHEIGHT``; both are what the stage resolved, so defaults show as the values they became."""

    id: str
    object: Literal["video"] = "video"
    status: VideoStatus
    created_at: int
    completed_at: int | None = None
    expires_at: int | None = None
    model: str
    prompt: str | None = None
    size: str
    seconds: str
    progress: int = 0
    error: VideoError | None = None
    remixed_from_video_id: str | None = None
    # Extensions: what the frame count and rate came to.
    num_frames: int | None = None
    fps: int | None = None


class VideoList(OpenAIBaseModel):
    """OpenAI's list envelope, newest first."""

    object: Literal["list"] = "list"
    data: list[VideoObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class VideoDeleted(OpenAIBaseModel):
    id: str
    object: Literal["video.deleted"] = "video.deleted"
    deleted: bool = True
