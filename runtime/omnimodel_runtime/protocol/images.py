"""Text-to-image on the wire: the OpenAI images API, chat answered with images, and the stage parameters.

``POST /v1/images/generations`` follows OpenAI's images API plus the extensions vLLM-Omni serves
(``negative_prompt``, ``num_inference_steps``, ``guidance_scale``, ``true_cfg_scale``, ``seed``, and the
size as ``height`` and ``width``). Chat completions on an image pipeline answer with the images as
``image_url`` data-URL parts of ``message.content`` (vLLM-Omni's behaviour). Every field the runtime acts
on is validated here, so a bad value is a 400 naming the field before any stage sees the request.

:class:`TextToImageParams` is what travels in ``StageRequest.params.image`` to the encode, denoise and
decode stages (or the one whole-pipeline stage); a stage server validates it again when it decodes a
request, since it may be called by something other than our gateway. Torch-free: the gateway imports
this module.
"""

from __future__ import annotations

import re
import time
from typing import Annotated, Final, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from omnimodel_runtime.protocol.openai import (
    Messages,
    OpenAIBaseModel,
    OpenAIRequestBody,
    Text,
    UsageInfo,
    random_id,
)

MAX_IMAGES: Final = 10
MAX_STEPS: Final = 200
# Largest side accepted; 4096² is 16× the pixels of Qwen-Image's native 1024², beyond which a single
# request would hold a GPU for minutes.
MAX_SIDE: Final = 4096
MAX_GUIDANCE: Final = 20.0
# OpenAI's bound on ``partial_images``.
MAX_PARTIAL_IMAGES: Final = 3
# Seeds are torch generator seeds; image i of a request uses seed + i, which must stay in range.
MAX_SEED: Final = 2**63 - 1 - MAX_IMAGES

# Largest side of an input image to edit (a phone photo is 4032x3024); the pipeline resizes it to about
# one megapixel, so more pixels only cost decoding time and memory.
MAX_SOURCE_SIDE: Final = 8192

# Name of the uint8 ``(n, height, width, 3)`` tensor an image pipeline's exit stage sends.
IMAGES_TENSOR: Final = "images"

_SIZE = re.compile(r"\s*(\d+)\s*[xX×]\s*(\d+)\s*")

Steps = Annotated[int, Field(ge=1, le=MAX_STEPS)]
Guidance = Annotated[float, Field(ge=0, le=MAX_GUIDANCE)]
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]
Side = Annotated[int, Field(ge=1, le=MAX_SIDE)]
# How much of a masked edit's schedule runs (diffusers' ``strength``): 1.0 starts the masked area from
# pure noise; 0 would run no step at all, which the pipeline refuses.
Strength = Annotated[float, Field(gt=0, le=1)]
NO_STRENGTH_WITHOUT_MASK: Final = (
    "must be 1.0 without a mask: this model's edit pipeline always denoises from pure noise beside the input "
    "image (it has no partial-strength image-to-image mode); a masked edit takes a strength in (0, 1]"
)


def parse_size(value: str) -> tuple[int, int]:
    """``"WIDTHxHEIGHT"`` → ``(width, height)``; raises a pydantic error whose message names the rule."""
    match = _SIZE.fullmatch(value)
    if match is None:
        raise PydanticCustomError(
            "image_size", "must look like WIDTHxHEIGHT, e.g. 1024x1024 (got {value})", {"value": repr(value)}
        )
    width, height = int(match.group(1)), int(match.group(2))
    if not (1 <= width <= MAX_SIDE and 1 <= height <= MAX_SIDE):
        raise PydanticCustomError(
            "image_size",
            "must be between 1x1 and {max}x{max} pixels (got {value})",
            {"value": repr(value), "max": MAX_SIDE},
        )
    return width, height


def _non_blank(value: str) -> str:
    if not value.strip():
        raise PydanticCustomError("empty_prompt", "must not be empty")
    return value


def _check_size(value: str | None) -> str | None:
    if value is not None and value.strip().lower() != "auto":
        parse_size(value)
    return value


def _dimensions(size: str | None) -> tuple[int | None, int | None]:
    """Width and height of a validated ``size``; ``None`` for the pipeline's default (absent or "auto")."""
    if size is None or size.strip().lower() == "auto":
        return None, None
    return parse_size(size)


class TextToImageParams(BaseModel):
    """Parameters of one text-to-image request, as every stage of the pipeline receives them.

    ``None`` means "the pipeline's own default" (its ``__call__`` defaults, e.g. 50 steps for Qwen-Image;
    its native size). Only the denoise stage uses ``seed``; image ``i`` of the request is generated from
    ``seed + i``, so one image of an ``n=2`` request repeats as the only image of a request with that seed.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    n: Annotated[int, Field(ge=1, le=MAX_IMAGES)] = 1
    width: Side | None = None
    height: Side | None = None
    num_inference_steps: Steps | None = None
    guidance_scale: Guidance | None = None
    true_cfg_scale: Guidance | None = None
    negative_prompt: Text | None = None
    seed: Seed | None = None

    @model_validator(mode="after")
    def _both_sides(self) -> Self:
        if (self.width is None) != (self.height is None):
            raise PydanticCustomError("image_size", "width and height must be given together")
        return self


class ImageEditParams(BaseModel):
    """The input image of an edit as every stage of the pipeline receives it: its size, from which the
    stages work out the size the pipeline encodes it at and the output's default size. Its bytes go to the
    entry stage only, as the request tensor its ``StageRequest.media`` entry names.

    ``mask``: the request also carries a mask (``media[1]``, the client's PNG whose fully transparent
    pixels are the area to edit), so it runs as ``QwenImageEditInpaintPipeline`` with ``strength``. Without
    a mask the edit pipeline has no partial-strength mode, so ``strength`` must stay 1.0 there.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    source_width: Annotated[int, Field(ge=1, le=MAX_SOURCE_SIDE)]
    source_height: Annotated[int, Field(ge=1, le=MAX_SOURCE_SIDE)]
    mask: bool = False
    strength: Strength = 1.0

    @model_validator(mode="after")
    def _strength_needs_a_mask(self) -> Self:
        if self.strength != 1.0 and not self.mask:
            raise PydanticCustomError("unsupported_parameter", NO_STRENGTH_WITHOUT_MASK)
        return self


# ---------------------------------------------------------------- POST /v1/images/generations


class _DiffusionFields(BaseModel):
    """The diffusion parameters every image request takes (vLLM-Omni's extensions beside OpenAI's ``n``
    and ``size``). No config of its own: a request's base class says how strictly they parse (JSON
    bodies strictly, an edit's form values from text)."""

    n: Annotated[int, Field(ge=1, le=MAX_IMAGES)] = 1
    seed: Seed | None = None
    negative_prompt: Text | None = None
    num_inference_steps: Steps | None = None
    guidance_scale: Guidance | None = None
    true_cfg_scale: Guidance | None = None
    size: str | None = None

    _size = field_validator("size")(_check_size)


class _ImageFields(_DiffusionFields, OpenAIRequestBody):
    """What the images API and image chat share: the diffusion parameters and the size as OpenAI's
    ``size``, or ``height`` and ``width`` (vLLM-Omni's names, as on image chat and ``/v1/videos``); both
    ways at once must agree. The model's size rule (Qwen-Image: multiples of 16) is the stage's to check."""

    height: Side | None = None
    # Validated even when absent: the check that width and height come together lives on it.
    width: Annotated[Side | None, Field(validate_default=True)] = None

    @field_validator("width")
    @classmethod
    def _one_size(cls, width: int | None, info: ValidationInfo) -> int | None:
        height, size = info.data.get("height"), info.data.get("size")
        if (width is None) != (height is None):
            raise PydanticCustomError("image_size", "width and height must be given together")
        if size is not None and width is not None and _dimensions(size) != (width, height):
            raise PydanticCustomError("image_size", "disagrees with size; send size, or width and height")
        return width

    def dimensions(self) -> tuple[int | None, int | None]:
        if self.width is not None:
            return self.width, self.height
        return _dimensions(self.size)

    def params(self) -> TextToImageParams:
        return _stage_params(self, *self.dimensions())


class ImageGenerationRequest(_ImageFields):
    """``POST /v1/images/generations``. OpenAI's API sizes images with ``size`` only; ``height`` and
    ``width`` are honoured too (a vLLM-Omni client sends them, as on its image chat), not ignored."""

    prompt: Text
    model: str | None = None
    # Images are returned inline; there is no file store to serve ``url`` responses from.
    response_format: Literal["b64_json"] | None = None
    output_format: Literal["png"] | None = None
    user: str | None = None
    # OpenAI's image streaming: ``image_generation.completed`` events (serving.images). No partial images
    # are sent, which OpenAI's contract allows ("the final image may be sent before the full number of
    # partial images"): the pipeline decodes only its last latents.
    stream: bool = False
    partial_images: Annotated[int, Field(ge=0, le=MAX_PARTIAL_IMAGES)] | None = None
    # OpenAI's knobs for its own models; a diffusion pipeline has no such modes. Only their neutral
    # values are accepted, anything else is a 400 naming the field (not silently ignored).
    quality: Literal["auto", "standard"] | None = None
    style: None = None
    background: Literal["auto"] | None = None
    moderation: Literal["auto"] | None = None
    output_compression: None = None

    @field_validator("quality", "style", "background", "moderation", "output_compression", mode="before")
    @classmethod
    def _only_neutral(cls, value: object, info: ValidationInfo) -> object:
        neutral = {"quality": ("auto", "standard"), "background": ("auto",), "moderation": ("auto",)}
        if value is not None and value not in neutral.get(info.field_name or "", ()):
            raise PydanticCustomError(
                "unsupported_parameter",
                "'{value}' is not supported: a diffusion pipeline has no such setting (leave it out)",
                {"value": value},
            )
        return value

    _prompt = field_validator("prompt")(_non_blank)


# ---------------------------------------------------------------- POST /v1/images/edits


class ImageEditRequest(_DiffusionFields, OpenAIBaseModel):
    """The text fields of ``POST /v1/images/edits`` (a multipart form: every value arrives as text, so
    numbers are parsed from it); the files (``image``, ``mask``) are checked by the service.

    Extensions beside OpenAI's fields: ``negative_prompt``, ``num_inference_steps``, ``true_cfg_scale``,
    ``guidance_scale``, ``seed`` (as for generations) and ``strength``. ``strength`` (0 < s <= 1) is
    diffusers' inpainting strength and is honoured for masked edits only; the service refuses another
    value than 1.0 without a mask (``QwenImageEditPipeline`` always denoises from pure noise beside the
    input image's latents), a 400 naming it rather than a setting silently ignored.
    """

    prompt: Text
    model: str | None = None
    response_format: Literal["b64_json"] | None = None
    output_format: Literal["png"] | None = None
    user: str | None = None
    strength: Strength | None = None
    # Streaming edits (``image_edit.*`` events) are not served: a 400, not a silent non-stream answer.
    stream: bool = False
    quality: Literal["auto", "standard"] | None = None
    background: Literal["auto"] | None = None
    input_fidelity: None = None
    output_compression: None = None

    _prompt = field_validator("prompt")(_non_blank)

    @field_validator("stream")
    @classmethod
    def _no_stream(cls, value: bool) -> bool:
        if value:
            raise PydanticCustomError("unsupported_parameter", "streaming edits are not supported; send stream=false")
        return value

    def params(self) -> TextToImageParams:
        return _stage_params(self, *_dimensions(self.size))


class ImageObject(OpenAIBaseModel):
    b64_json: str | None = None
    url: str | None = None
    revised_prompt: str | None = None


class ImagesResponse(OpenAIBaseModel):
    created: int = Field(default_factory=lambda: int(time.time()))
    data: list[ImageObject]
    output_format: Literal["png"] = "png"
    size: str | None = None


class ImageStreamUsage(OpenAIBaseModel):
    """The usage of an image stream, in OpenAI's shape: prompt tokens in, no tokens out (pixels)."""

    input_tokens: int = 0
    input_tokens_details: dict[str, int] = Field(default_factory=lambda: {"image_tokens": 0, "text_tokens": 0})
    output_tokens: int = 0
    total_tokens: int = 0


class ImageGenerationCompletedEvent(OpenAIBaseModel):
    """``event: image_generation.completed``: one finished image of a ``stream: true`` request."""

    type: Literal["image_generation.completed"] = "image_generation.completed"
    b64_json: str
    created_at: int
    size: str
    quality: Literal["auto"] = "auto"
    background: Literal["opaque"] = "opaque"
    output_format: Literal["png"] = "png"
    usage: ImageStreamUsage


# ---------------------------------------------------------------- chat completions answered with images


class ImageChatCompletionRequest(_ImageFields):
    """``POST /v1/chat/completions`` on a pipeline whose output is images.

    The prompt is the text of the last user message. Size comes as ``size`` (as in the images API) or
    as ``height`` and ``width`` (vLLM-Omni's chat extensions); ``n`` (or vLLM-Omni's
    ``num_outputs_per_prompt``) images up to 10. vLLM-Omni's clients nest all of these in ``extra_body``. Text sampling
    fields (temperature, max_tokens, ...) mean nothing to a diffusion model and are ignored.
    """

    messages: Messages
    model: str | None = None
    stream: bool = False
    # vLLM-Omni's name for ``n`` on image chat (its example clients always send it).
    num_outputs_per_prompt: Annotated[int, Field(ge=1, le=MAX_IMAGES)] | None = None
    modalities: list[Literal["text", "image"]] | None = None

    @model_validator(mode="after")
    def _one_count(self) -> Self:
        count = self.num_outputs_per_prompt
        if count is not None:
            if "n" in self.model_fields_set and self.n != count:
                raise PydanticCustomError(
                    "image_count",
                    "n ({n}) and num_outputs_per_prompt ({count}) disagree; send one",
                    {"n": self.n, "count": count, "param": "num_outputs_per_prompt"},
                )
            self.n = count
        return self


def _stage_params(req: _DiffusionFields, width: int | None, height: int | None) -> TextToImageParams:
    """What the stages get of any of the three requests."""
    return TextToImageParams(
        n=req.n,
        width=width,
        height=height,
        num_inference_steps=req.num_inference_steps,
        guidance_scale=req.guidance_scale,
        true_cfg_scale=req.true_cfg_scale,
        negative_prompt=req.negative_prompt,
        seed=req.seed,
    )


class ImageURL(OpenAIBaseModel):
    url: str


class ImageContentPart(OpenAIBaseModel):
    type: Literal["image_url"] = "image_url"
    image_url: ImageURL


class ImageChatMessage(OpenAIBaseModel):
    role: Literal["assistant"] = "assistant"
    content: list[ImageContentPart]


class ImageChatChoice(OpenAIBaseModel):
    index: int = 0
    message: ImageChatMessage
    logprobs: None = None
    finish_reason: str = "stop"


class ImageChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ImageChatChoice]
    usage: UsageInfo
