"""Images out of a pipeline: ``/v1/images/generations`` and chat completions on an image pipeline.

OpenAI request → one stage request (the prompt, and the diffusion parameters in ``params.image``) → the chain
of stages the image needs → ``(n, H, W, 3)`` uint8 pixels from the exit stage → PNG → base64 in the
response (``data[i].b64_json``, or an ``image_url`` data URL in ``message.content`` for chat, as
vLLM-Omni answers). PNG encoding runs on a worker thread (zlib releases the GIL): at 1024² it takes tens
of milliseconds, which must not stall the gateway's event loop.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import time
import zlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np

from omnimodel_runtime.errors import StageError
from omnimodel_runtime.pipeline import Modality, Pipeline
from omnimodel_runtime.protocol.images import (
    IMAGES_TENSOR,
    ImageChatChoice,
    ImageChatCompletionRequest,
    ImageChatCompletionResponse,
    ImageChatMessage,
    ImageContentPart,
    ImageGenerationCompletedEvent,
    ImageGenerationRequest,
    ImageObject,
    ImagesResponse,
    ImageStreamUsage,
    ImageURL,
    TextToImageParams,
)
from omnimodel_runtime.protocol.openai import ChatMessageParam, UsageInfo
from omnimodel_runtime.protocol.stage import FinalFrame, StageParams, StageRequest, TensorFrame
from omnimodel_runtime.serving.base import Service, aclose
from omnimodel_runtime.serving.errors import APIError
from omnimodel_runtime.serving.media import check_text_only
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


class ImageService(Service):
    """``/v1/images/generations`` and image chat over the stage chain that outputs images."""

    def stage_request(self, prompt: str, params: TextToImageParams, request_id: str) -> StageRequest:
        return StageRequest(
            request_id=request_id,
            prompt=prompt,
            deadline=self.deadline(),
            stream=False,
            params=StageParams(image=params),
        )

    async def generate(self, request: StageRequest, n: int) -> Generated:
        """Run the chain to the image exit stage and collect its ``n`` images."""
        images: list[np.ndarray] = []
        prompt_tokens = 0
        frames = self.orchestrator.generate_chain(request, [Modality.IMAGE])
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

    async def chat(self, req: ImageChatCompletionRequest) -> ImageChatCompletionResponse:
        """``POST /v1/chat/completions`` on an image pipeline: the images as data-URL content parts."""
        self.check_model(req.model)
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
