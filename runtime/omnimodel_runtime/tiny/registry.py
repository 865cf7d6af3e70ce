"""Which function builds the tiny model of which preset.

Builders live in their own modules and are imported only when called, so listing presets (and the
operator-facing parts of the runtime) never pulls in torch. Later presets add one entry here.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol

from omnimodel_runtime.errors import ExtraMissingError


class BuildFunction(Protocol):
    def __call__(self, out: Path, *, seed: int, **options: Any) -> None: ...


@dataclass(frozen=True)
class TinyBuilder:
    """Where the builder of one preset's tiny model lives and what it needs installed."""

    module: str
    function: str
    extra: str
    # Bumped whenever the builder's output changes, so cached builds of an older layout are not reused.
    version: int = 1
    default_seed: int = 0

    def load(self) -> BuildFunction:
        try:
            module = importlib.import_module(self.module)
        except ImportError as err:
            raise ExtraMissingError(what=f"building tiny models ({self.module})", extra=self.extra, cause=err) from err
        fn: BuildFunction = getattr(module, self.function)
        return fn


TINY_BUILDERS: Final[Mapping[str, TinyBuilder]] = {
    "text": TinyBuilder(module="omnimodel_runtime.tiny.text", function="build", extra="transformers"),
    "tts": TinyBuilder(module="omnimodel_runtime.tiny.tts", function="build", extra="tts"),
    # v2: the released chat template (audio and image parts) and a processor config (audio and image input).
    "qwen2.5-omni": TinyBuilder(
        module="omnimodel_runtime.tiny.omni", function="build", extra="transformers", version=2
    ),
    # Qwen2.5-Omni with the token ids vLLM-Omni hard-codes, for the vllm-omni runtime.
    "qwen2.5-omni-vllm-omni": TinyBuilder(
        module="omnimodel_runtime.tiny.omni_vllm_omni", function="build", extra="transformers"
    ),
    # v2: audio and image input (a processor config, the Qwen3 placeholders named and templated, the
    # default audio window) and a middle accept_hidden_layer.
    "qwen3-omni": TinyBuilder(
        module="omnimodel_runtime.tiny.qwen3_omni", function="build", extra="transformers", version=2
    ),
    # Qwen3-Omni with the token ids and sizes vLLM-Omni hard-codes, for the vllm-omni runtime.
    "qwen3-omni-vllm-omni": TinyBuilder(
        module="omnimodel_runtime.tiny.qwen3_omni_vllm", function="build", extra="transformers"
    ),
    # Wan2.2 TI2V-5B's layout (one expert, the 48-channel Wan2.2 VAE, expand_timesteps), for vLLM-Omni's
    # wan2_2_ti2v config on the vllm-omni runtime.
    "text-to-video-ti2v-vllm-omni": TinyBuilder(
        module="omnimodel_runtime.tiny.wan22_vllm", function="build", extra="diffusers"
    ),
    # Qwen3-TTS (CustomVoice) with the ids and layout vLLM-Omni hard-codes, for its qwen3_tts config on the
    # vllm-omni runtime (transformers has no Qwen3-TTS: the checkpoint is written tensor by tensor).
    "tts-qwen3-vllm-omni": TinyBuilder(
        module="omnimodel_runtime.tiny.qwen3_tts_vllm", function="build", extra="transformers"
    ),
    "text-to-image": TinyBuilder(module="omnimodel_runtime.tiny.text_to_image", function="build", extra="diffusers"),
    "qwen-image-edit": TinyBuilder(module="omnimodel_runtime.tiny.image_edit", function="build", extra="diffusers"),
    # v2: rope_max_seq_len 1024 (v1's 32 failed at the default and every OpenAI size).
    "text-to-video": TinyBuilder(
        module="omnimodel_runtime.tiny.text_to_video", function="build", extra="diffusers", version=2
    ),
}


def tiny_presets() -> tuple[str, ...]:
    """Presets that have a tiny variant."""
    return tuple(TINY_BUILDERS)


def get_builder(preset: str) -> TinyBuilder:
    """The builder for ``preset``; a clear error lists the known ones."""
    try:
        return TINY_BUILDERS[preset]
    except KeyError:
        known = ", ".join(TINY_BUILDERS)
        raise ValueError(f"no tiny model for preset {preset!r} (known: {known})") from None


def build_tiny(preset: str, out: Path, *, seed: int | None = None, **options: Any) -> Path:
    """Build the tiny model of ``preset`` into ``out`` (created; must not hold another model).
    ``options`` go to the builder (e.g. ``size`` for a real-size random-weight variant)."""
    builder = get_builder(preset)
    out.mkdir(parents=True, exist_ok=True)
    builder.load()(out, seed=builder.default_seed if seed is None else seed, **options)
    return out
