"""Audio and image input of the Omni thinkers: the request's media bytes through the model's own processor
(``Qwen2_5OmniProcessor``, ``Qwen3OmniMoeProcessor``: Whisper features for audio, Qwen2-VL patches for
images, placeholder tokens expanded to one per encoder output), ready for the thinker's ``generate()``.

- **Audio** (``wav``/``mp3``/``flac`` files) is decoded by libsndfile, mixed down to mono and resampled to
  the feature extractor's rate (16 kHz for the released model).
- **Images** are decoded by Pillow and converted to RGB.
- **The processor** is the checkpoint's (``preprocessor_config.json``). transformers builds its video
  processor only with torchvision; without it the processor is built from its other parts (the same
  classes and code paths for text, audio and images) and video input is not available.

A file that cannot be decoded is a 400 naming its content part.
"""

from __future__ import annotations

import functools
import io
import logging
import types
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
import soundfile
import torch
from transformers import (
    AutoTokenizer,
    Qwen2_5OmniProcessor,
    Qwen2VLImageProcessor,
    WhisperFeatureExtractor,
)

from omnimodel_runtime.engines.audio import resample
from omnimodel_runtime.engines.images import decode_image
from omnimodel_runtime.engines.omni.common import quiet_transformers
from omnimodel_runtime.errors import StageError
from omnimodel_runtime.protocol.stage import MediaInput, StageRequest

log = logging.getLogger(__name__)

PROCESSOR_FILE: Final = "preprocessor_config.json"
# The placeholder part types of the stage messages (serving.media.PLACEHOLDER), one per media input.
_PLACEHOLDERS: Final = frozenset({"audio", "image"})


@functools.cache
def _without_video(processor: Any) -> Any:
    """``processor`` (an Omni processor class) without its video processor (which needs torchvision): the
    video slot holds the image processor's patch geometry, all the placeholder expansion reads of it
    without videos."""

    def check_argument_for_proper_class(self: Any, argument_name: str, argument: Any) -> Any:
        if argument_name == "video_processor":
            return None
        return processor.check_argument_for_proper_class(self, argument_name, argument)

    return type(
        f"{processor.__name__}WithoutVideo",
        (processor,),
        {"check_argument_for_proper_class": check_argument_for_proper_class},
    )


def load_processor(model_dir: Path, processor: Any = Qwen2_5OmniProcessor) -> Any | None:
    """The checkpoint's Omni processor (``processor``: ``Qwen2_5OmniProcessor`` or
    ``Qwen3OmniMoeProcessor``), or None when it ships no processor config."""
    if not (model_dir / PROCESSOR_FILE).is_file():
        return None
    with quiet_transformers():
        try:
            return processor.from_pretrained(model_dir)
        except ImportError as err:  # torchvision, for the video processor
            # transformers' message starts with a newline: its first line of text says what is missing.
            reason = next(iter(str(err).strip().splitlines()), type(err).__name__)
            log.info("Building the Omni processor without video input (%s)", reason)
        image = Qwen2VLImageProcessor.from_pretrained(model_dir)
        geometry = types.SimpleNamespace(merge_size=image.merge_size, temporal_patch_size=image.temporal_patch_size)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        return _without_video(processor)(
            image_processor=image,
            video_processor=geometry,
            feature_extractor=WhisperFeatureExtractor.from_pretrained(model_dir),
            tokenizer=tokenizer,
            chat_template=tokenizer.chat_template,
        )


@dataclass(frozen=True)
class Decoded:
    """A request's media, decoded: audio waveforms at the feature extractor's rate, RGB images."""

    audio: list[np.ndarray]
    images: list[Any]


def decode_audio(data: np.ndarray, media: MediaInput, rate: int) -> np.ndarray:
    """A mono float32 waveform at ``rate`` from the bytes of an audio file."""
    try:
        samples, source_rate = soundfile.read(io.BytesIO(data.tobytes()), dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError) as err:
        raise StageError(
            f"{media.param}: cannot decode the audio as {media.format}: {err}", status=400, param=media.param
        ) from err
    if samples.shape[0] == 0:
        raise StageError(f"{media.param}: the audio has no samples", status=400, param=media.param)
    mono = samples.mean(axis=1) if samples.shape[1] > 1 else samples[:, 0]
    return resample(np.ascontiguousarray(mono, dtype=np.float32), int(source_rate), rate)


def decode(request: StageRequest, tensors: Mapping[str, np.ndarray], rate: int) -> Decoded:
    """The request's media in message order, each checked against its placeholder in the messages."""
    placeholders = [
        part.get("type")
        for message in request.messages or ()
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if isinstance(part, Mapping) and part.get("type") in _PLACEHOLDERS
    ]
    if placeholders != [m.kind for m in request.media]:
        raise StageError("the request's media do not match the placeholders of its messages", status=400)
    audio: list[np.ndarray] = []
    images: list[Any] = []
    for media in request.media:
        data = tensors.get(media.tensor)
        if data is None or data.dtype != np.uint8 or data.ndim != 1:
            raise StageError(f"{media.param}: its bytes did not arrive with the request", status=400)
        if media.kind == "audio":
            audio.append(decode_audio(data, media, rate))
        else:
            images.append(decode_image(data, media.param))
    return Decoded(audio=audio, images=images)


def processor_inputs(processor: Any, text: str, decoded: Decoded) -> dict[str, torch.Tensor]:
    """The processor's output for one rendered prompt and its media: ``input_ids`` with the placeholders
    expanded, plus ``input_features``/``feature_attention_mask`` and ``pixel_values``/``image_grid_thw``."""
    out = processor(
        text=[text],
        audio=decoded.audio or None,
        images=decoded.images or None,
        return_tensors="pt",
    )
    return {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}
