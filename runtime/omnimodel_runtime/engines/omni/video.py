"""Video input of the Qwen2.5-Omni and Qwen3-Omni thinkers: a video file decoded to frames (and, with
``use_audio_in_video``, its audio track), sampled as the model's reference pipeline samples them, and
turned into the vision encoder's patches by :class:`VideoProcessor`.

**Decoding** is FFmpeg's, through PyAV (the wheel bundles FFmpeg): any container and codec it reads
(mp4, webm, mkv, mov, ...), frames converted to RGB by FFmpeg.

**Sampling** follows qwen-omni-utils (the model card's preprocessing): frames at :data:`SAMPLE_FPS` (2 per
second, the rate the processor's time positions assume), a multiple of the temporal patch (2 frames),
at least ``min_frames`` (4) and at most ``max_frames`` (768) and the video's own frame count, evenly
spaced from the first frame to the last; the rate of the frames taken is what the processor is told
(``fps``: each temporal patch spans ``temporal_patch_size / fps`` seconds). ``num_frames`` (vLLM-Omni's
``video_url.num_frames``) asks for that many frames instead.

**The video processor.** transformers' ``Qwen2VLVideoProcessor`` (both Omni processors') is written on
torchvision, and PyPI's torchvision is built for the CUDA torch: beside the CPU torch its import fails
(``operator torchvision::nms does not exist``). Patching it importable would also switch every transformers
image processor to its torchvision backend (other pixels on every image path) and change what vLLM
imports, so :class:`VideoProcessor` does the Qwen2-VL video processor's steps in torch alone: the same
``smart_resize`` geometry (transformers' own function, with the per-frame pixel cap of qwen-vl-utils,
``cap_pixels_per_frame``), the bicubic antialiased resize torchvision runs on CPU for uint8 frames
(``torch.nn.functional.interpolate`` on uint8), the fused rescale and normalisation in float32, the last
frame repeated up to a whole temporal patch, and the same patch layout.
tests/component/runtime/test_omni_video.py checks it against transformers' own processor's output
(computed with torchvision once, kept as hashes).
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Final, TypedDict

import av
import numpy as np
import torch
from transformers.feature_extraction_utils import BatchFeature
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from omnimodel_runtime.engines.audio import resample
from omnimodel_runtime.errors import StageError
from omnimodel_runtime.protocol.stage import MediaInput

# The frame rate the Omni processor's time positions assume when it is not told one, and the rate
# qwen-omni-utils samples at.
SAMPLE_FPS: Final = 2.0
# PIL's BICUBIC, the only resampling the released processor config names.
_BICUBIC: Final = 3
# Qwen2VLVideoProcessor's class defaults (a checkpoint's config overrides them).
_DEFAULTS: Final[Mapping[str, Any]] = {
    "size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768},
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "rescale_factor": 1 / 255,
    "do_resize": True,
    "do_rescale": True,
    "do_normalize": True,
    "resample": _BICUBIC,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "min_frames": 4,
    "max_frames": 768,
    "max_video_tokens": 128000,
}
# The files a checkpoint keeps its video processor's settings in, most specific first (transformers'
# order): a nested ``video_processor`` entry, its own file, else the image processor's settings.
_PROCESSOR_FILE: Final = "processor_config.json"
_VIDEO_FILE: Final = "video_preprocessor_config.json"
_IMAGE_FILE: Final = "preprocessor_config.json"


@dataclass(frozen=True)
class Video:
    """A decoded video: the sampled RGB frames (T, H, W, 3) uint8, their rate, and (when asked for) its
    audio track as a mono float32 waveform at the feature extractor's rate."""

    frames: np.ndarray
    fps: float
    audio: np.ndarray | None = None


def frame_indices(
    total: int, video_fps: float, *, num_frames: int | None, min_frames: int, max_frames: int, factor: int
) -> np.ndarray:
    """Which of ``total`` frames to take (see the module docstring); at least ``factor`` frames."""
    if num_frames is not None:
        count = round(num_frames / factor) * factor
    else:
        count_f = min(max(total / video_fps * SAMPLE_FPS, min_frames), max_frames)
        count = math.floor(count_f / factor) * factor
    count = min(count, total // factor * factor)
    count = max(count, factor)
    return np.linspace(0, total - 1, count).round().astype(np.int64)


def _open(data: np.ndarray, media: MediaInput) -> Any:
    try:
        return av.open(io.BytesIO(data.tobytes()), mode="r")
    except (av.FFmpegError, ValueError) as err:
        raise _undecodable(media, err) from err


def _undecodable(media: MediaInput, err: BaseException) -> StageError:
    # FFmpeg's own words ("Invalid data found when processing input"), without its error number.
    reason = getattr(err, "strerror", None) or err
    return StageError(
        f"{media.param}: cannot decode the video ({media.format}): {reason}", status=400, param=media.param
    )


def decode_video(
    data: np.ndarray, media: MediaInput, *, min_frames: int, max_frames: int, factor: int, audio_rate: int | None
) -> Video:
    """The sampled frames of a video file (and its audio track at ``audio_rate`` unless that is None).

    Two passes over the (in-memory) file: one counts the frames, one keeps the sampled ones, so only
    those are ever converted to RGB and held."""
    with _open(data, media) as container:
        if not container.streams.video:
            raise StageError(f"{media.param}: the file has no video stream", status=400, param=media.param)
        stream = container.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate
        try:
            total = sum(1 for _ in container.decode(stream))
        except (av.FFmpegError, ValueError) as err:
            raise _undecodable(media, err) from err
    if not rate or rate <= 0:
        raise StageError(f"{media.param}: the video does not say its frame rate", status=400, param=media.param)
    if total < factor:
        raise StageError(
            f"{media.param}: the video has {total} frame(s); at least {factor} are needed (send a single frame "
            "as an image_url part)",
            status=400,
            param=media.param,
        )
    video_fps = float(rate)
    indices = frame_indices(
        total, video_fps, num_frames=media.num_frames, min_frames=min_frames, max_frames=max_frames, factor=factor
    )
    # Strictly increasing (at most one index per frame), so the frames come out in order.
    wanted = {int(i) for i in indices}
    with _open(data, media) as container:
        try:
            frames = [
                frame.to_ndarray(format="rgb24")
                for i, frame in enumerate(container.decode(container.streams.video[0]))
                if i in wanted
            ]
        except (av.FFmpegError, ValueError) as err:
            raise _undecodable(media, err) from err
    if len(frames) != len(indices):
        raise StageError(f"{media.param}: the video decoded differently twice", status=400, param=media.param)
    audio = None if audio_rate is None else decode_audio_track(data, media, audio_rate)
    return Video(frames=np.stack(frames), fps=len(indices) / total * video_fps, audio=audio)


def decode_audio_track(data: np.ndarray, media: MediaInput, rate: int) -> np.ndarray:
    """The video file's first audio track, mixed to mono and resampled to ``rate`` (as audio input is)."""
    with _open(data, media) as container:
        if not container.streams.audio:
            raise StageError(
                f"{media.param}: the video has no audio track (mm_processor_kwargs.use_audio_in_video)",
                status=400,
                param=media.param,
            )
        stream = container.streams.audio[0]
        # Planar float at the track's own layout and rate: the mixing and resampling are ours.
        planar = av.AudioResampler(format="fltp")
        chunks: list[np.ndarray] = []
        source_rate = 0
        try:
            for frame in container.decode(stream):
                source_rate = frame.sample_rate
                chunks.extend(out.to_ndarray() for out in planar.resample(frame))
            chunks.extend(out.to_ndarray() for out in planar.resample(None))
        except (av.FFmpegError, ValueError) as err:
            raise _undecodable(media, err) from err
    if not chunks or not source_rate:
        raise StageError(f"{media.param}: the video's audio track is empty", status=400, param=media.param)
    mono = np.concatenate(chunks, axis=1).mean(axis=0)
    return resample(np.ascontiguousarray(mono, dtype=np.float32), source_rate, rate)


class _CallKwargs(TypedDict, total=False):
    """What :class:`VideoProcessor` takes beyond the Omni processor's own video arguments (transformers
    routes a processor call's arguments to a part by the part's ``valid_kwargs``)."""

    cap_pixels_per_frame: bool


class VideoProcessor:
    """The Qwen2-VL video processor's preprocessing in torch alone (see the module docstring), called by
    ``Qwen2_5OmniProcessor`` and ``Qwen3OmniMoeProcessor`` as their ``video_processor``: frames already
    sampled (as transformers' with ``do_sample_frames`` off, its default) → ``pixel_values_videos``
    (patches, float32) and ``video_grid_thw``. Runs on the CPU (the resize is the CPU one)."""

    # Read by the Omni processor's own model_input_names.
    model_input_names: ClassVar[list[str]] = ["pixel_values_videos", "video_grid_thw"]
    valid_kwargs: ClassVar[type] = _CallKwargs

    def __init__(self, settings: Mapping[str, Any]) -> None:
        config = {**_DEFAULTS, **{k: v for k, v in settings.items() if k in _DEFAULTS}}
        size = dict(config["size"])
        # Qwen2VLVideoProcessor's backward compatibility: min_pixels/max_pixels override the size.
        if settings.get("min_pixels") is not None:
            size["shortest_edge"] = settings["min_pixels"]
        if settings.get("max_pixels") is not None:
            size["longest_edge"] = settings["max_pixels"]
        self.resample = int(config["resample"])
        self.size: dict[str, int] = size
        self.image_mean: list[float] = list(config["image_mean"])
        self.image_std: list[float] = list(config["image_std"])
        self.rescale_factor = float(config["rescale_factor"])
        self.do_resize = bool(config["do_resize"])
        self.do_rescale = bool(config["do_rescale"])
        self.do_normalize = bool(config["do_normalize"])
        self.patch_size = int(config["patch_size"])
        self.temporal_patch_size = int(config["temporal_patch_size"])
        self.merge_size = int(config["merge_size"])
        self.min_frames = int(config["min_frames"])
        self.max_frames = int(config["max_frames"])
        self.max_video_tokens = int(config["max_video_tokens"])

    @classmethod
    def from_pretrained(cls, model_dir: Path) -> VideoProcessor:
        """The checkpoint's video processor settings, from the file transformers would read them from."""
        nested = model_dir / _PROCESSOR_FILE
        if nested.is_file():
            entry = json.loads(nested.read_text()).get("video_processor")
            if entry is not None:
                return cls(entry)
        for name in (_VIDEO_FILE, _IMAGE_FILE):
            path = model_dir / name
            if path.is_file():
                settings: dict[str, Any] = json.loads(path.read_text())
                return cls(settings)
        raise FileNotFoundError(f"{model_dir}: no video processor settings ({_VIDEO_FILE} or {_IMAGE_FILE})")

    def __call__(
        self,
        videos: Sequence[np.ndarray],
        *,
        size: Mapping[str, int] | None = None,
        cap_pixels_per_frame: bool = True,
        return_tensors: str | None = None,
        fps: float | None = None,
    ) -> BatchFeature:
        """``fps`` is the rate of the frames given, which the Omni processor reads itself: the frames are
        not resampled here."""
        del fps
        bounds = {**self.size, **(size or {})}
        patches: list[torch.Tensor] = []
        grids: list[list[int]] = []
        for video in videos:
            flat, grid = self._one(np.asarray(video), bounds, cap_pixels_per_frame)
            patches.append(flat)
            grids.append(grid)
        return BatchFeature(
            data={"pixel_values_videos": torch.cat(patches, dim=0), "video_grid_thw": torch.tensor(grids)},
            tensor_type=return_tensors,
        )

    def _one(self, video: np.ndarray, bounds: Mapping[str, int], cap: bool) -> tuple[torch.Tensor, list[int]]:
        if video.ndim != 4 or video.shape[-1] != 3 or video.dtype != np.uint8:
            raise ValueError(f"a video is (frames, height, width, 3) uint8, not {video.shape} {video.dtype}")
        frames = torch.from_numpy(np.ascontiguousarray(video)).permute(0, 3, 1, 2).contiguous()
        count, channels, height, width = frames.shape
        factor = self.patch_size * self.merge_size
        if self.do_resize:
            if self.resample != _BICUBIC:
                # Refused when used, not when loaded: the processor of a model that takes no video still loads.
                raise ValueError(f"video processor: resample={self.resample} (only bicubic, 3, is implemented)")
            max_pixels = int(bounds["longest_edge"])
            if cap:
                # qwen-vl-utils' bound on a whole video: each frame gets at most an even share of
                # max_video_tokens' pixels, but never less than 1.05 x the minimum.
                total_pixels = int(self.max_video_tokens * factor * factor * 0.9)
                max_pixels = max(
                    min(max_pixels, total_pixels * self.temporal_patch_size // count),
                    int(bounds["shortest_edge"] * 1.05),
                )
            new_h, new_w = smart_resize(
                height, width, factor=factor, min_pixels=int(bounds["shortest_edge"]), max_pixels=max_pixels
            )
            if (new_h, new_w) != (height, width):
                # torchvision's resize on CPU for uint8 and bicubic: the native uint8 kernel, no cast.
                frames = torch.nn.functional.interpolate(
                    frames, size=[new_h, new_w], mode="bicubic", align_corners=False, antialias=True
                )
            height, width = new_h, new_w
        pixels = frames.to(torch.float32)
        if self.do_rescale and self.do_normalize:
            # Fused as transformers fuses them: (x - mean/scale) / (std/scale), in float32.
            mean = torch.tensor(self.image_mean) * (1.0 / self.rescale_factor)
            std = torch.tensor(self.image_std) * (1.0 / self.rescale_factor)
            pixels = pixels.sub_(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))
        elif self.do_normalize:
            pixels = pixels.sub_(torch.tensor(self.image_mean).view(-1, 1, 1)).div_(
                torch.tensor(self.image_std).view(-1, 1, 1)
            )
        elif self.do_rescale:
            pixels = pixels * self.rescale_factor
        temporal = self.temporal_patch_size
        if pad := -count % temporal:
            pixels = torch.cat([pixels, pixels[-1:].expand(pad, -1, -1, -1)], dim=0)
            count += pad
        grid_t, grid_h, grid_w = count // temporal, height // self.patch_size, width // self.patch_size
        merge, patch = self.merge_size, self.patch_size
        blocks = pixels.view(
            grid_t, temporal, channels, grid_h // merge, merge, patch, grid_w // merge, merge, patch
        ).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        flat = blocks.reshape(grid_t * grid_h * grid_w, channels * temporal * patch * patch)
        return flat, [grid_t, grid_h, grid_w]
