"""What the two TTS stages share, without torch: where each stage's weights are, voices, generation
bounds and the vocoder's chunk plan.

The chunk plan is exact by construction: every window carries the vocoder's full receptive field, so
streamed and whole-utterance output differ only where a convolution runs over a window instead of the
whole sequence (float rounding, never a seam).
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np

from omnimodel_runtime.errors import RuntimeSetupError
from omnimodel_runtime.layout import SPEECH_CONFIG

log = logging.getLogger(__name__)

DEFAULT_VOICE: Final = "default"
VOICE_NAME: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def stage_dir(model_dir: Path, engine_args: Mapping[str, Any], default: str) -> Path:
    """Where one stage's weights are: ``engine_args["path"]`` (absolute, or relative to the model
    directory), else the stage's subdirectory when it holds a model, else the model directory itself
    (a plain ``microsoft/speecht5_tts`` snapshot serves as the acoustic stage as it is)."""
    given = engine_args.get("path")
    if given:
        path = Path(str(given))
        return path if path.is_absolute() else model_dir / path
    sub = model_dir / default
    return sub if (sub / "config.json").is_file() else model_dir


@dataclass(frozen=True)
class GenerationBounds:
    """SpeechT5's stopping rule: stop once the stop head's probability (summed over the reduction
    factor) reaches ``threshold``, but not before ``minlenratio`` and not after ``maxlenratio`` decoder
    steps per encoder position, divided by the reduction factor (``generate()``'s arguments)."""

    threshold: float = 0.5
    minlenratio: float = 0.0
    maxlenratio: float = 20.0

    @classmethod
    def load(cls, model_dir: Path, engine_args: Mapping[str, Any]) -> GenerationBounds:
        """``speech.json`` in the model directory (when present), overridden by engine arguments."""
        data: dict[str, Any] = {}
        path = model_dir / SPEECH_CONFIG
        if path.is_file():
            loaded = json.loads(path.read_text())
            if not isinstance(loaded, dict):
                raise RuntimeSetupError(f"{path} must hold a JSON object")
            data.update(loaded)
        for key in ("threshold", "minlenratio", "maxlenratio"):
            if key in engine_args:
                data[key] = engine_args[key]
        try:
            bounds = cls(
                threshold=float(data.get("threshold", cls.threshold)),
                minlenratio=float(data.get("minlenratio", cls.minlenratio)),
                maxlenratio=float(data.get("maxlenratio", cls.maxlenratio)),
            )
        except (TypeError, ValueError) as err:
            raise RuntimeSetupError(f"invalid speech generation bounds {data}: {err}") from err
        if not 0 <= bounds.minlenratio <= bounds.maxlenratio or bounds.maxlenratio <= 0:
            raise RuntimeSetupError(f"need 0 <= minlenratio <= maxlenratio and maxlenratio > 0, got {bounds}")
        return bounds


def load_voices(voices_dir: Path, dim: int) -> dict[str, np.ndarray]:
    """Named speaker embeddings (``<name>.npy``, ``dim`` float values each). A ``default`` voice always
    exists: the shipped ``default.npy``, else a zero embedding (SpeechT5 normalises the embedding, so
    zero means "no speaker conditioning")."""
    voices: dict[str, np.ndarray] = {}
    if voices_dir.is_dir():
        for path in sorted(voices_dir.glob("*.npy")):
            name = path.stem
            if not VOICE_NAME.match(name):
                log.warning("Skipped voice file %s: the name must match %s", path, VOICE_NAME.pattern)
                continue
            emb = np.load(path, allow_pickle=False)
            emb = np.asarray(emb, dtype=np.float32).reshape(-1)
            if emb.shape != (dim,):
                raise RuntimeSetupError(f"voice {path} has {emb.size} values; the acoustic model needs {dim}")
            if not np.isfinite(emb).all():
                raise RuntimeSetupError(f"voice {path} holds NaN or infinite values")
            voices[name] = emb
    voices.setdefault(DEFAULT_VOICE, np.zeros(dim, dtype=np.float32))
    return voices


@dataclass(frozen=True)
class ChunkWindow:
    """Vocode input frames ``[lo, hi)`` and keep the output of frames ``[start, end)``."""

    lo: int
    start: int
    end: int
    hi: int


class ChunkPlan:
    """When and over which window a streaming vocoder runs.

    A chunk of frames ``[start, end)`` is vocoded over ``[start - context, end + context)`` (clipped to
    the utterance), where ``context`` covers the vocoder's receptive field: every output sample kept
    then sees exactly the input it would see in a whole-utterance run, so chunks join without seams.
    Chunks start small (``first`` frames, for a short time to first audio) and double up to ``largest``
    (each chunk recomputes ``2 * context`` frames, so later chunks are larger to amortise that).
    """

    def __init__(self, *, first: int, largest: int, context: int) -> None:
        if first < 1 or largest < first or context < 0:
            raise ValueError(f"need 1 <= first <= largest and context >= 0 (got {first}, {largest}, {context})")
        self.first, self.largest, self.context = first, largest, context
        self.done = 0
        self._target = first

    def next(self, available: int, *, finished: bool) -> ChunkWindow | None:
        """The next window to vocode with ``available`` input frames, or ``None`` to wait for more."""
        ready = available if finished else available - self.context
        start = self.done
        if ready <= start or (not finished and ready - start < self._target):
            return None
        end = min(ready, start + self.largest)
        window = ChunkWindow(
            lo=max(0, start - self.context), start=start, end=end, hi=min(available, end + self.context)
        )
        self.done = end
        self._target = min(self.largest, self._target * 2)
        return window


def hifigan_context_frames(
    *,
    upsample_rates: Iterable[int],
    upsample_kernel_sizes: Iterable[int],
    resblock_kernel_sizes: Iterable[int],
    resblock_dilation_sizes: Iterable[Iterable[int]],
    pre_kernel: int = 7,
    post_kernel: int = 7,
) -> int:
    """How many mel frames on each side one HiFi-GAN output sample depends on (an upper bound).

    Each layer's reach, in samples at its own rate, is divided by the upsampling done so far: the
    input convolution, then per level a transposed convolution (``ceil(kernel / stride)`` inputs) and
    the widest residual block (a dilated and a plain convolution per dilation), then the output
    convolution. The tiny and the released SpeechT5 HiFi-GAN both reach 24 frames; this gives 26.
    """
    reach = (pre_kernel - 1) / 2
    rate = 1
    dilations = [list(d) for d in resblock_dilation_sizes]
    kernels = list(resblock_kernel_sizes)
    for stride, kernel in zip(upsample_rates, upsample_kernel_sizes, strict=True):
        reach += math.ceil(kernel / stride) / rate
        rate *= stride
        block = max(
            sum((k - 1) // 2 * d + (k - 1) // 2 for d in dil) for k, dil in zip(kernels, dilations, strict=True)
        )
        reach += block / rate
    reach += (post_kernel - 1) / 2 / rate
    return math.ceil(reach)
