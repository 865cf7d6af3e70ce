"""What the three Qwen2.5-Omni stage engines (thinker, talker, code2wav) share.

- **Loading** each part from ONE full checkpoint (``thinker.*``, ``talker.*``, ``token2wav.*`` keys) and
  checking that every weight of the part was found (``Qwen2_5OmniToken2WavModel.from_pretrained`` on a
  full checkpoint reports success but leaves every weight random, so token2wav is loaded by prefix).
- **The edge formats** (frame kinds, tensor names, dtypes; documented in docs/pipelines/qwen2.5-omni.md).
- **Speakers** (``spk_dict.pt``) and voice resolution, identical in every stage that needs it.
- **Per-request randomness** for Hugging Face ``generate()``: its sampling draws from the process-global
  generator, which the thinker and talker (and other requests) would otherwise share. :class:`RngTurn`
  lends the global generator to one request for exactly the span of one sampling step.

The engine base the three share, one request at a time on a worker thread, is :mod:`.engine`.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import secrets
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
import torch
from transformers import Qwen2_5OmniConfig
from transformers.utils import logging as hf_logging

from omnimodel_runtime.errors import StageError
from omnimodel_runtime.layout import OMNI_GENERATION_FILE, OMNI_SPEAKER_FILE
from omnimodel_runtime.protocol.speech import resolve_voice
from omnimodel_runtime.protocol.stage import (
    StageRequest,
    TensorFrame,
)

log = logging.getLogger(__name__)

# ---------------------------------------------------------------- edge formats

# ``TensorFrame.meta["kind"]`` of each frame crossing an internal edge.
PROMPT_KIND: Final = "omni.thinker.prompt"  # thinker -> talker, once, after the thinker's prefill
REPLY_KIND: Final = "omni.thinker.reply"  # thinker -> talker, one row per generated text token
CODES_KIND: Final = "omni.talker.codes"  # talker -> code2wav, codec codes as they are sampled
RNG_KIND: Final = "omni.talker.rng"  # talker -> code2wav, the talker's generator state at its end
AUDIO_META: Final = {"modality": "audio"}  # code2wav -> client (plus sample_rate)
# Tensors of the prompt frame of a request with media: what the talker's M-RoPE positions need.
AUDIO_LENGTHS: Final = "audio_feature_lengths"  # int64 (audios,): mel frames of each audio
IMAGE_GRID: Final = "image_grid_thw"  # int64 (images, 3): each image's patch grid
VIDEO_GRID: Final = "video_grid_thw"  # int64 (videos, 3): each video's patch grid
VIDEO_SECONDS: Final = "video_second_per_grid"  # float32 (videos,): seconds each temporal patch spans
# Prompt frame meta: the video's audio track is interleaved with its frames (the M-RoPE positions differ).
USE_AUDIO_IN_VIDEO: Final = "use_audio_in_video"

SAMPLE_RATE: Final = 24000
# The whole model's generate() uses this voice when none is named.
DEFAULT_VOICE: Final = "Chelsie"
# The seed of a speech request that names none.
SPEECH_SEED: Final = 0

# bfloat16 has no numpy dtype: such rows travel as their raw 16-bit patterns (lossless, 2 bytes a value).
_BF16: Final = "bfloat16"


def rows_to_wire(rows: torch.Tensor) -> tuple[np.ndarray, str]:
    """A (n, H) tensor as a numpy array plus the torch dtype name the receiver restores."""
    rows = rows.detach().to("cpu").contiguous()
    if rows.dtype == torch.bfloat16:
        return rows.view(torch.int16).numpy().view(np.uint16), _BF16
    return rows.numpy(), str(rows.dtype).removeprefix("torch.")


def rows_from_wire(arr: np.ndarray, dtype: str, device: str) -> torch.Tensor:
    """Inverse of :func:`rows_to_wire` (a copy: wire arrays are read-only views of the body)."""
    if dtype == _BF16:
        return torch.from_numpy(np.array(arr, dtype=np.uint16).view(np.int16)).view(torch.bfloat16).to(device)
    expected = getattr(torch, dtype, None)
    tensor = torch.from_numpy(np.array(arr))
    if not isinstance(expected, torch.dtype) or tensor.dtype != expected:
        raise StageError(f"rows arrived as {arr.dtype}, declared {dtype}", status=400)
    return tensor.to(device)


# ---------------------------------------------------------------- loading


_quiet_lock = threading.Lock()
_quiet_depth = [0, 0]  # [threads inside, verbosity to restore]


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Loading a part from a full checkpoint makes transformers report every other part's keys as
    "unexpected" (and print progress bars); completeness is checked here instead, so that is noise.
    Counted, because the three stages of ``serve`` load concurrently and share transformers' logger."""
    hf_logging.disable_progress_bar()
    with _quiet_lock:
        if _quiet_depth[0] == 0:
            _quiet_depth[1] = hf_logging.get_verbosity()
            hf_logging.set_verbosity_error()
        _quiet_depth[0] += 1
    try:
        yield
    finally:
        with _quiet_lock:
            _quiet_depth[0] -= 1
            if _quiet_depth[0] == 0:
                hf_logging.set_verbosity(_quiet_depth[1])


def load_config(model_dir: Path) -> Any:
    with quiet_transformers():
        return Qwen2_5OmniConfig.from_pretrained(model_dir)


def load_part(cls: Any, model_dir: Path, sub_config: Any, *, dtype: Any, device: str) -> Any:
    """``cls`` (thinker or talker class) with its weights from the full checkpoint in ``model_dir``.

    transformers strips the part's prefix (its ``base_model_prefix``) and leaves the other parts' keys
    unused; a part with any weight left unloaded is an error, not a warning.
    """
    with quiet_transformers():
        model, info = cls.from_pretrained(model_dir, config=sub_config, dtype=dtype, output_loading_info=True)
    missing = [k for k in info.get("missing_keys", ()) if k]
    if missing:
        raise RuntimeError(f"{model_dir} lacks {len(missing)} weights of {cls.__name__} (e.g. {missing[:3]})")
    return model.to(device).eval()


def load_prefixed(module: torch.nn.Module, model_dir: Path, prefix: str) -> None:
    """Load every ``<prefix>``-keyed tensor of the checkpoint into ``module`` strictly."""
    from safetensors import safe_open  # noqa: PLC0415  (part of the runtime extra; only engines need it)

    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = sorted({f for k, f in weight_map.items() if k.startswith(prefix)})
    else:
        files = ["model.safetensors"]
    state: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(str(model_dir / name), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118  (safe_open handles are not mappings)
                if key.startswith(prefix):
                    state[key[len(prefix) :]] = f.get_tensor(key)
    if not state:
        raise RuntimeError(f"{model_dir} has no weights under {prefix!r}")
    module.load_state_dict(state, strict=True)


def generation_overrides(model_dir: Path, part: str, engine_args: Mapping[str, Any]) -> dict[str, Any]:
    """Stage parameters from the model directory's :data:`OMNI_GENERATION_FILE` (``{part: {...}}``), then the
    stage's ``engine_args`` (``{part}_{key}`` or a ``generation`` mapping) on top."""
    path = model_dir / OMNI_GENERATION_FILE
    data = json.loads(path.read_text()) if path.is_file() else {}
    out = dict(data.get(part, {}))
    out.update(engine_args.get("generation", {}) or {})
    prefix = f"{part}_"
    out.update({k[len(prefix) :]: v for k, v in engine_args.items() if k.startswith(prefix)})
    return out


# ---------------------------------------------------------------- speakers


@dataclass(frozen=True)
class Speakers:
    """The voices of ``spk_dict.pt``: ``{name: {bos_token, cond, ref_mel}}`` (Qwen2.5-Omni), or of a config's
    speaker map: ``{name: {codec_id}}`` (Qwen3-Omni); ``preferred`` is the whole model's default voice."""

    entries: Mapping[str, Mapping[str, Any]]
    preferred: str = DEFAULT_VOICE

    @classmethod
    def load(cls, model_dir: Path) -> Speakers:
        path = model_dir / OMNI_SPEAKER_FILE
        if not path.is_file():
            raise RuntimeError(f"{model_dir} has no {OMNI_SPEAKER_FILE}: the model has no voices")
        data = torch.load(path, weights_only=True, map_location="cpu")
        return cls(entries={str(k): v for k, v in data.items()})

    @property
    def names(self) -> list[str]:
        return list(self.entries)

    @property
    def default(self) -> str:
        """The whole model's default voice, else the first one."""
        return self.preferred if self.preferred in self.entries else self.names[0]

    def resolve(self, voice: str | None, *, param: str = "audio.voice") -> str:
        """The speaker-map key for ``voice`` (:func:`~omnimodel_runtime.protocol.speech.resolve_voice`)."""
        return resolve_voice(voice, self.names, self.default, param=param)

    def __getitem__(self, name: str) -> Mapping[str, Any]:
        return self.entries[name]


def voice_param(request: StageRequest) -> str:
    """The API field that names the voice, for error messages: ``/v1/audio/speech`` requests (the thinker
    speaks their text verbatim) name it ``voice``, chat requests ``audio.voice``."""
    return "voice" if request.params.speak else "audio.voice"


def request_seed(request: StageRequest) -> int:
    """The seed of the talker's sampling and code2wav's noise. Speech without a seed uses
    :data:`SPEECH_SEED` (as the ``tts`` preset: the same request gives the same audio); a chat without
    one gets a fresh random seed (as the whole model without ``manual_seed``)."""
    seed = request.sampling.seed
    if seed is not None:
        return seed
    return SPEECH_SEED if request.params.speak else secrets.randbits(63)


# ---------------------------------------------------------------- randomness


class RngTurn:
    """One request's random stream, lent to Hugging Face's sampling step through the global generator.

    ``generate()`` samples with ``torch.multinomial`` on the process-global generator of the logits'
    device. Installed as a forward hook (:meth:`begin`, after the logits exist) and a stopping criterion
    (:meth:`end`, right after the token was drawn), this swaps the request's state in and out under a
    process-wide lock, so concurrent stages and requests never draw from each other's stream, and the
    draws equal those of the whole model seeded with the same seed. The lock is held only between the
    two calls (logits processing and one ``multinomial``), never while waiting for input.
    """

    _lock: Final = threading.Lock()

    def __init__(self, device: str, seed: int) -> None:
        self._device = torch.device(device)
        gen = torch.Generator(device=self._device)
        gen.manual_seed(seed)
        self.state = gen.get_state()
        self._held = False

    def _get(self) -> torch.Tensor:
        if self._device.type == "cpu":
            return torch.get_rng_state()
        state: torch.Tensor = torch.get_device_module(self._device.type).get_rng_state(self._device)
        return state

    def _set(self, state: torch.Tensor) -> None:
        if self._device.type == "cpu":
            torch.set_rng_state(state)
        else:
            torch.get_device_module(self._device.type).set_rng_state(state, self._device)

    def begin(self) -> None:
        if not self._held:
            self._lock.acquire()
            self._held = True
            self._set(self.state)

    def end(self) -> None:
        if self._held:
            self.state = self._get()
            self._held = False
            self._lock.release()

    def generator(self) -> torch.Generator:
        """A private generator continuing this stream (for draws outside ``generate()``)."""
        gen = torch.Generator(device=self._device)
        gen.set_state(self.state)
        return gen


def generate(model: Any, **kwargs: Any) -> Any:
    """``model.generate(**kwargs)``, its generation parameters handed over as a ``GenerationConfig``: the
    model's own updated with them, which is what ``generate()`` makes of the same arguments itself. Handed
    none, ``generate()`` first checks ``model.config`` for legacy generation parameters by building a
    default instance of the config's class: for Qwen2.5-Omni's thinker config, with its audio, vision and
    text sub-configs, ~60 ms of validation per call under cProfile on a 2-core CPU (the talker's ~10 ms),
    paid by every prefill before its first token (``bench/omni_timeline.py`` with ``OMNI_TIMELINE_PROFILE``)."""
    config = copy.deepcopy(model.generation_config)
    rest = config.update(**kwargs)
    return model.generate(generation_config=config, **rest)


def tensor_frame(kind: str, tensors: Mapping[str, np.ndarray], **meta: Any) -> TensorFrame:
    return TensorFrame(tensors=dict(tensors), meta={"kind": kind, **meta})
