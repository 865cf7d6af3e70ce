"""Audio, image and video input of the Omni thinkers: the request's media bytes through the model's own
processor (``Qwen2_5OmniProcessor``, ``Qwen3OmniMoeProcessor``: Whisper features for audio, Qwen2-VL patches
for images and video frames, placeholder tokens expanded to one per encoder output), ready for the
thinker's ``generate()``.

- **Audio** (``wav``/``mp3``/``flac`` files) is decoded by libsndfile, mixed down to mono and resampled to
  the feature extractor's rate (16 kHz for the released model).
- **Images** are decoded by Pillow and converted to RGB.
- **Video** (any container and codec FFmpeg reads) is decoded by PyAV and sampled at 2 frames a second
  (:mod:`.video`); with ``use_audio_in_video`` its audio track goes in as well, as an audio input the
  processor interleaves with the frames (Qwen2.5-Omni: 2-second chunks of frames, then of audio;
  Qwen3-Omni: token by token, by their time positions), exactly as the model's processor does for the
  whole model. One video per request: the
  processor takes one frame rate per call.
- **The processor** is the checkpoint's (``preprocessor_config.json``). transformers builds its video
  processor only with torchvision, which the CPU torch cannot import; without it the processor is built
  from its other parts (the same classes and code paths for text, audio and images) with
  :class:`~.video.VideoProcessor` (the Qwen2-VL video processor's steps in torch, checked equal to
  transformers' own) in the video processor's slot.

A file that cannot be decoded is a 400 naming its content part.
"""

from __future__ import annotations

import functools
import io
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
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
from omnimodel_runtime.engines.omni.video import VideoProcessor, decode_video
from omnimodel_runtime.errors import StageError
from omnimodel_runtime.protocol.stage import MediaInput, StageRequest

log = logging.getLogger(__name__)

PROCESSOR_FILE: Final = "preprocessor_config.json"
# The placeholder part types of the stage messages (serving.media.PLACEHOLDER), one per media input.
_PLACEHOLDERS: Final = frozenset({"audio", "image", "video"})


@functools.cache
def _with_torch_video(processor: Any) -> Any:
    """``processor`` (an Omni processor class) taking :class:`~.video.VideoProcessor` in its video
    processor's slot (transformers checks that slot's class: it expects its own torchvision-based one)."""

    def check_argument_for_proper_class(self: Any, argument_name: str, argument: Any) -> Any:
        if argument_name == "video_processor":
            return None
        return processor.check_argument_for_proper_class(self, argument_name, argument)

    return type(
        f"{processor.__name__}WithTorchVideo",
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
        except ImportError as err:  # torchvision, for transformers' video processor
            # transformers' message starts with a newline: its first line of text says what is missing.
            reason = next(iter(str(err).strip().splitlines()), type(err).__name__)
            log.info("Building the Omni processor with the torch video processor (%s)", reason)
    return build_processor(model_dir, processor)


def build_processor(model_dir: Path, processor: Any = Qwen2_5OmniProcessor) -> Any:
    """The checkpoint's processor with :class:`~.video.VideoProcessor` as its video processor (what
    :func:`load_processor` returns without torchvision)."""
    with quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        return _with_torch_video(processor)(
            image_processor=Qwen2VLImageProcessor.from_pretrained(model_dir),
            video_processor=VideoProcessor.from_pretrained(model_dir),
            feature_extractor=WhisperFeatureExtractor.from_pretrained(model_dir),
            tokenizer=tokenizer,
            chat_template=tokenizer.chat_template,
        )


@dataclass(frozen=True)
class Decoded:
    """A request's media, decoded: audio waveforms at the feature extractor's rate (a video's audio
    track among them, in its place, with ``use_audio_in_video``), RGB images, the sampled frames of the
    video and their rate."""

    audio: list[np.ndarray]
    images: list[Any]
    videos: list[np.ndarray] = field(default_factory=list)
    fps: float | None = None
    # Per audio input: None for an audio part, the video's index for a video's track.
    audio_from_video: list[int | None] = field(default_factory=list)

    @property
    def use_audio_in_video(self) -> bool:
        return any(source is not None for source in self.audio_from_video)


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


def decode(request: StageRequest, tensors: Mapping[str, np.ndarray], rate: int, video_processor: Any) -> Decoded:
    """The request's media in message order, each checked against its placeholder in the messages
    (``video_processor``: the processor's, whose settings say how many frames to take)."""
    placeholders = [
        part.get("type")
        for message in request.messages or ()
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if isinstance(part, Mapping) and part.get("type") in _PLACEHOLDERS
    ]
    if placeholders != [m.kind for m in request.media]:
        raise StageError("the request's media do not match the placeholders of its messages", status=400)
    videos = [m for m in request.media if m.kind == "video"]
    if len(videos) > 1:
        raise StageError(
            f"{videos[1].param}: one video per request (the processor takes one frame rate per request)",
            status=400,
            param=videos[1].param,
        )
    audio: list[np.ndarray] = []
    images: list[Any] = []
    frames: list[np.ndarray] = []
    fps: float | None = None
    sources: list[int | None] = []
    for media in request.media:
        data = tensors.get(media.tensor)
        if data is None or data.dtype != np.uint8 or data.ndim != 1:
            raise StageError(f"{media.param}: its bytes did not arrive with the request", status=400)
        if media.kind == "audio":
            audio.append(decode_audio(data, media, rate))
            sources.append(None)
        elif media.kind == "image":
            images.append(decode_image(data, media.param))
        else:
            video = decode_video(
                data,
                media,
                min_frames=int(video_processor.min_frames),
                max_frames=int(video_processor.max_frames),
                factor=int(video_processor.temporal_patch_size),
                audio_rate=rate if media.use_audio else None,
            )
            frames.append(video.frames)
            fps = video.fps
            if video.audio is not None:
                # In the video's place among the audio inputs: the processor takes them in text order.
                audio.append(video.audio)
                sources.append(len(frames) - 1)
    return Decoded(audio=audio, images=images, videos=frames, fps=fps, audio_from_video=sources)


def processor_inputs(processor: Any, text: str, decoded: Decoded) -> dict[str, torch.Tensor]:
    """The processor's output for one rendered prompt and its media: ``input_ids`` with the placeholders
    expanded, plus ``input_features``/``feature_attention_mask``, ``pixel_values``/``image_grid_thw`` and
    ``pixel_values_videos``/``video_grid_thw``/``video_second_per_grid``."""
    video: dict[str, Any] = {}
    if decoded.videos:
        # The per-frame pixel cap of qwen-vl-utils, which transformers makes its default in 5.22: both
        # video processors then give the same patches, whichever transformers is installed.
        video = {"fps": decoded.fps, "cap_pixels_per_frame": True}
        if decoded.use_audio_in_video:
            video.update(audio_in_video_kwargs(processor, decoded.audio_from_video))
    out = processor(
        text=[text],
        audio=decoded.audio or None,
        images=decoded.images or None,
        videos=decoded.videos or None,
        return_tensors="pt",
        **video,
    )
    return {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}


def audio_in_video_kwargs(processor: Any, audio_from_video: list[int | None]) -> dict[str, Any]:
    """The processor arguments that interleave videos with their audio tracks (already decoded, among the
    audio inputs; ``audio_from_video``: each one's video index, None for an audio part). transformers 5.19
    takes ``use_audio_in_video``; 5.24's omni-modal processor base deprecates it for
    ``load_audio_from_video`` plus the source of every audio input, without which it counts a video's track
    as an audio part with no placeholder and refuses the prompt."""
    if hasattr(processor, "load_audio_from_video"):
        return {"load_audio_from_video": True, "audio_from_video_indices": audio_from_video}
    return {"use_audio_in_video": True}
