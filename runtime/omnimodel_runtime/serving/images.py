"""Images out of a pipeline: ``/v1/images/generations``, ``/v1/images/edits`` and chat completions on an
image pipeline.

OpenAI request → one stage request (the prompt, and the diffusion parameters in ``params.image``) → the chain
of stages the image needs → ``(n, H, W, 3)`` uint8 pixels from the exit stage → PNG → base64 in the
response (``data[i].b64_json``, or an ``image_url`` data URL in ``message.content`` for chat, as
vLLM-Omni answers). An edit's input image is checked here from its header (PNG, JPEG or WebP; its size
within bounds) and travels to the entry stage as its file's bytes (``StageRequest.media``), where the
engine decodes it. PNG encoding runs on a worker thread (zlib releases the GIL): at 1024² it takes tens
of milliseconds, which must not stall the gateway's event loop.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import time
import zlib
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
from pydantic import ValidationError

from omnimodel_runtime.errors import StageError
from omnimodel_runtime.pipeline import InputModality, Modality, Pipeline, Route
from omnimodel_runtime.protocol.images import (
    IMAGES_TENSOR,
    MAX_SOURCE_SIDE,
    NO_STRENGTH_WITHOUT_MASK,
    ImageChatChoice,
    ImageChatCompletionRequest,
    ImageChatCompletionResponse,
    ImageChatMessage,
    ImageContentPart,
    ImageEditParams,
    ImageEditRequest,
    ImageGenerationCompletedEvent,
    ImageGenerationRequest,
    ImageObject,
    ImagesResponse,
    ImageStreamUsage,
    ImageURL,
    TextToImageParams,
)
from omnimodel_runtime.protocol.openai import ChatMessageParam, UsageInfo
from omnimodel_runtime.protocol.stage import FinalFrame, MediaInput, StageParams, StageRequest, TensorFrame
from omnimodel_runtime.serving.base import Service, aclose
from omnimodel_runtime.serving.errors import APIError, invalid
from omnimodel_runtime.serving.image_files import image_info, png_has_alpha
from omnimodel_runtime.serving.media import NO_FETCH, MediaPolicy, chat_content, check_text_only
from omnimodel_runtime.serving.orchestrator import Orchestrator
from omnimodel_runtime.serving.sse import DONE, sse

_PNG_SIGNATURE: Final = b"\x89PNG\r\n\x1a\n"
_PNG_COLOR_TYPES: Final = {1: 0, 3: 2, 4: 6}  # grey, RGB, RGBA
# zlib's default: what PIL writes too. Level 1 is ~3x faster and ~15% larger on photographs.
PNG_LEVEL: Final = 6


def answers_chat_with_images(pipeline: Pipeline) -> bool:
    """Chat on this pipeline answers with images (it outputs images and no text)."""
    return Modality.IMAGE in pipeline.modalities and Modality.TEXT not in pipeline.modalities


def encode_png(image: np.ndarray, *, level: int = PNG_LEVEL) -> bytes:
    """A PNG file of a uint8 ``(H, W)``, ``(H, W, 1|3|4)`` image (8-bit, no interlace, filter "none")."""
    arr = np.asarray(image)
    if arr.dtype != np.uint8:
        raise ValueError(f"PNG encoding needs uint8 pixels, got {arr.dtype}")
    if arr.ndim == 2:
        arr = arr[:, :, None]
    if arr.ndim != 3 or arr.shape[2] not in _PNG_COLOR_TYPES:
        raise ValueError(f"PNG encoding needs (H, W[, 1|3|4]) pixels, got shape {arr.shape}")
    height, width, channels = arr.shape
    rows = np.zeros((height, 1 + width * channels), dtype=np.uint8)  # column 0: each row's filter type
    rows[:, 1:] = arr.reshape(height, width * channels)
    header = struct.pack(">IIBBBBB", width, height, 8, _PNG_COLOR_TYPES[channels], 0, 0, 0)
    return b"".join(
        (
            _PNG_SIGNATURE,
            _png_chunk(b"IHDR", header),
            _png_chunk(b"IDAT", zlib.compress(rows.tobytes(), level)),
            _png_chunk(b"IEND", b""),
        )
    )


def _png_chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))


def prompt_from_messages(messages: Sequence[ChatMessageParam]) -> str:
    """The image prompt of a chat: the text of the last user message (text parts joined by spaces)."""
    for message in reversed(messages):
        if message.role != "user":
            continue
        if isinstance(message.content, list):
            return " ".join(p.text for p in message.content if p.type == "text" and p.text)
        return message.content or ""
    return ""


@dataclass(frozen=True)
class Generated:
    """What the stages produced for one request."""

    images: list[np.ndarray]
    prompt_tokens: int


# The form fields an edit's files come in: ``image`` (one file) or ``image[]`` (the openai client's name for
# a list of them), and ``mask``.
IMAGE_FIELDS: Final = ("image", "image[]")
MASK_FIELD: Final = "mask"
# The request tensors that carry an edit's input image file and its mask file.
EDIT_IMAGE_TENSOR: Final = "image"
EDIT_MASK_TENSOR: Final = "mask"


class ImageService(Service):
    """``/v1/images/generations``, ``/v1/images/edits`` and image chat over the stage chain that outputs
    images."""

    def __init__(self, orchestrator: Orchestrator, *, request_timeout: float, media: MediaPolicy = NO_FETCH) -> None:
        super().__init__(orchestrator, request_timeout=request_timeout)
        self.media = media

    def stage_request(
        self,
        prompt: str,
        params: TextToImageParams,
        request_id: str,
        *,
        edit: ImageEditParams | None = None,
        media: tuple[MediaInput, ...] = (),
    ) -> StageRequest:
        return StageRequest(
            request_id=request_id,
            prompt=prompt,
            deadline=self.deadline(),
            stream=False,
            media=media,
            params=StageParams(image=params, edit=edit),
        )

    async def generate(
        self, request: StageRequest, n: int, tensors: Mapping[str, np.ndarray] | None = None
    ) -> Generated:
        """Run the chain to the image exit stage and collect its ``n`` images."""
        images: list[np.ndarray] = []
        prompt_tokens = 0
        frames = self.orchestrator.generate_chain(request, [Modality.IMAGE], tensors=tensors)
        try:
            async for _, frame in frames:
                if isinstance(frame, TensorFrame) and IMAGES_TENSOR in frame.tensors:
                    images.extend(np.asarray(frame.tensors[IMAGES_TENSOR]))
                elif isinstance(frame, FinalFrame):
                    prompt_tokens += frame.usage.prompt_tokens
        finally:
            # Closing the chain early (an error, a client gone) cancels every stage still working.
            await aclose(frames)
        if len(images) != n:
            raise StageError(f"the pipeline returned {len(images)} images for n={n}", status=502)
        return Generated(images=images, prompt_tokens=prompt_tokens)

    async def create(self, req: ImageGenerationRequest) -> ImagesResponse | AsyncIterator[bytes]:
        """``POST /v1/images/generations``: PNGs as base64; with ``stream``, as OpenAI's image events."""
        self.check_model(req.model)
        request = self.stage_request(req.prompt, req.params(), self.request_id())
        generated = await self.generate(request, req.n)
        pngs = await asyncio.to_thread(_encode_all, generated.images)
        height, width = generated.images[0].shape[:2]
        b64 = [base64.b64encode(png).decode("ascii") for png in pngs]
        if req.stream:
            return _completed_events(b64, f"{width}x{height}", generated.prompt_tokens)
        return ImagesResponse(data=[ImageObject(b64_json=b) for b in b64], size=f"{width}x{height}")

    async def edit(self, fields: Mapping[str, str], files: Mapping[str, Sequence[bytes]]) -> ImagesResponse:
        """``POST /v1/images/edits``: the form's text ``fields`` and its ``files`` (by field name) → PNGs.

        One input image per request (``QwenImageEditPipeline`` takes one) and at most one ``mask``:
        OpenAI's, a PNG of the image's size whose fully transparent pixels are the area to edit. A masked
        edit runs as diffusers' ``QwenImageEditInpaintPipeline`` (same checkpoint) with ``strength``; an
        unmasked one takes only ``strength`` 1.0, all the edit pipeline does.
        """
        try:
            req = ImageEditRequest.model_validate(dict(fields))
        except ValidationError as err:
            raise invalid(err) from None
        self.check_model(req.model)
        images = [data for name in IMAGE_FIELDS for data in files.get(name, ())]
        if not images:
            raise APIError("image: an edit needs an input image (a PNG, JPEG or WebP file)", param="image")
        if len(images) > 1:
            raise APIError(f"image: this model edits one image per request (got {len(images)})", param="image")
        masks = files.get(MASK_FIELD, ())
        if len(masks) > 1:
            raise APIError(f"mask: an edit takes one mask (got {len(masks)})", param=MASK_FIELD)
        strength = 1.0 if req.strength is None else req.strength
        if not masks and strength != 1.0:
            raise APIError(f"strength: {NO_STRENGTH_WITHOUT_MASK}", param="strength")
        mask = masks[0] if masks else None
        generated = await self._edit(
            req.prompt, req.params(), req.n, images[0], param="image", mask=mask, strength=strength
        )
        pngs = await asyncio.to_thread(_encode_all, generated.images)
        out_height, out_width = generated.images[0].shape[:2]
        return ImagesResponse(
            data=[ImageObject(b64_json=base64.b64encode(png).decode("ascii")) for png in pngs],
            size=f"{out_width}x{out_height}",
        )

    def _check_file(self, data: bytes, param: str) -> tuple[str, int, int]:
        """The MIME type and size of an uploaded image file, from its header; errors name ``param``."""
        if len(data) > self.media.max_bytes:
            raise APIError(f"{param}: the file is larger than {self.media.max_bytes} bytes", param=param)
        info = image_info(data)
        if info is None:
            raise APIError(f"{param}: the file is not a PNG, JPEG or WebP image", param=param)
        _, width, height = info
        if not (1 <= width <= MAX_SOURCE_SIDE and 1 <= height <= MAX_SOURCE_SIDE):
            raise APIError(
                f"{param}: the image is {width}x{height} pixels; each side must be between 1 and {MAX_SOURCE_SIDE}",
                param=param,
            )
        return info

    def _check_mask(self, data: bytes, size: tuple[int, int]) -> None:
        """OpenAI's rules for ``mask``, from the file's header: a PNG with transparency (its fully
        transparent pixels say where to edit), of the input image's size."""
        mime, width, height = self._check_file(data, MASK_FIELD)
        if mime != "image/png":
            raise APIError(f"mask: must be a PNG file (got {mime})", param=MASK_FIELD)
        if not png_has_alpha(data):
            raise APIError(
                "mask: the PNG has no alpha channel; its fully transparent pixels mark the area to edit",
                param=MASK_FIELD,
            )
        if (width, height) != size:
            raise APIError(
                f"mask: the mask is {width}x{height} pixels but the image is {size[0]}x{size[1]}; they must match",
                param=MASK_FIELD,
            )

    async def _edit(
        self,
        prompt: str,
        params: TextToImageParams,
        n: int,
        data: bytes,
        *,
        param: str,
        mask: bytes | None = None,
        strength: float = 1.0,
    ) -> Generated:
        """Edit the image file ``data`` (checked from its header; errors name ``param``) by ``prompt``; with
        a ``mask`` file, only where it is fully transparent."""
        mime, width, height = self._check_file(data, param)
        media = [MediaInput(kind="image", tensor=EDIT_IMAGE_TENSOR, format=mime, param=param)]
        tensors = {EDIT_IMAGE_TENSOR: np.frombuffer(data, dtype=np.uint8)}
        if mask is not None:
            self._check_mask(mask, (width, height))
            media.append(MediaInput(kind="image", tensor=EDIT_MASK_TENSOR, format="image/png", param=MASK_FIELD))
            tensors[EDIT_MASK_TENSOR] = np.frombuffer(mask, dtype=np.uint8)
        edit = ImageEditParams(source_width=width, source_height=height, mask=mask is not None, strength=strength)
        request = self.stage_request(prompt, params, self.request_id(), edit=edit, media=tuple(media))
        return await self.generate(request, n, tensors)

    async def _chat_edit_image(self, messages: Sequence[ChatMessageParam]) -> tuple[bytes, str]:
        """The one input image of an edit asked for in chat (vLLM-Omni's image-edit client sends it as an
        ``image_url`` part beside the prompt's text) and the name of its part."""
        content = chat_content(
            messages, accepts=(InputModality.TEXT, InputModality.IMAGE), model=self.model_name, policy=self.media
        )
        await content.fetch(self.media)
        if not content.media:
            raise APIError(
                "messages: an edit needs an input image: an image_url part (a data URL) in the user message",
                param="messages",
            )
        if len(content.media) > 1:
            extra = content.media[1].param
            raise APIError(f"{extra}: this model edits one image per request (got {len(content.media)})", param=extra)
        image = content.media[0]
        return content.tensors[image.tensor].tobytes(), image.param

    async def chat(self, req: ImageChatCompletionRequest) -> ImageChatCompletionResponse:
        """``POST /v1/chat/completions`` on an image pipeline: the images as data-URL content parts. On an edit
        pipeline the user message carries the image to edit as an ``image_url`` part (vLLM-Omni's way)."""
        self.check_model(req.model)
        edit_image: tuple[bytes, str] | None = None
        if Route.IMAGE_EDITS in self.orchestrator.pipeline.routes:
            edit_image = await self._chat_edit_image(req.messages)
        else:
            # Text to image reads the text of the messages only: any other part is refused, not dropped.
            check_text_only(req.messages, model=self.model_name)
        if req.stream:
            raise APIError("streaming is not supported when the answer is an image; send stream=false", param="stream")
        if req.modalities is not None and "image" not in req.modalities:
            raise APIError(
                f"model {self.model_name!r} answers with images; modalities must include image", param="modalities"
            )
        prompt = prompt_from_messages(req.messages)
        if not prompt.strip():
            raise APIError("the last user message has no text to draw", param="messages")
        request_id = self.request_id()
        if edit_image is not None:
            data, param = edit_image
            generated = await self._edit(prompt, req.params(), req.n, data, param=param)
        else:
            generated = await self.generate(self.stage_request(prompt, req.params(), request_id), req.n)
        pngs = await asyncio.to_thread(_encode_all, generated.images)
        parts = [
            ImageContentPart(image_url=ImageURL(url="data:image/png;base64," + base64.b64encode(png).decode("ascii")))
            for png in pngs
        ]
        return ImageChatCompletionResponse(
            id=f"chatcmpl-{request_id}",
            model=self.model_name,
            choices=[ImageChatChoice(message=ImageChatMessage(content=parts))],
            usage=UsageInfo(prompt_tokens=generated.prompt_tokens, total_tokens=generated.prompt_tokens),
        )


async def _completed_events(images: Sequence[str], size: str, prompt_tokens: int) -> AsyncIterator[bytes]:
    """A ``stream: true`` answer: one ``image_generation.completed`` event per image, then ``[DONE]``.

    The images are generated before the stream starts, so a refused or failed request still gets its
    status and error envelope. There are no ``partial_image`` events: the stages hand only the final
    latents to the decoder (OpenAI allows the final image before any partial one)."""
    created = int(time.time())
    usage = ImageStreamUsage(
        input_tokens=prompt_tokens,
        input_tokens_details={"image_tokens": 0, "text_tokens": prompt_tokens},
        total_tokens=prompt_tokens,
    )
    for b64 in images:
        event = ImageGenerationCompletedEvent(b64_json=b64, created_at=created, size=size, usage=usage)
        yield sse(event, event=event.type)
    yield DONE


def _encode_all(images: Sequence[np.ndarray]) -> list[bytes]:
    return [encode_png(image) for image in images]
