"""What the Qwen3-Omni stage engines share: the config, the voices (codec ids), the loading fixes for
transformers' Qwen3-Omni classes, and the mixture-of-experts switch (:func:`moe_experts`)."""

from __future__ import annotations

import logging
import threading
from typing import Any, Final

import torch
from transformers import Qwen3OmniMoeConfig

from omnimodel_runtime.engines.omni.common import Speakers, quiet_transformers
from omnimodel_runtime.engines.omni.engine import OmniEngine
from omnimodel_runtime.engines.omni.moe import use_grouped_experts

log = logging.getLogger(__name__)

# The whole model's generate() default voice.
DEFAULT_VOICE: Final = "Ethan"
# The whole model's generate() defaults for its talker (eos and the suppressed ids come from the config).
TALKER_DEFAULTS: Final[dict[str, Any]] = {
    "max_new_tokens": 4096,
    "do_sample": True,
    "top_k": 50,
    "top_p": 1.0,
    "temperature": 0.9,
    "repetition_penalty": 1.05,
}
# The whole model suppresses the last 1024 ids of the codec vocabulary (all but end-of-speech).
SUPPRESSED_TAIL: Final = 1024
# The whole model's code2wav chunking (codes): chunks of 300 with 25 codes of left context.


def load_config(model_dir: Any) -> Any:
    with quiet_transformers():
        return Qwen3OmniMoeConfig.from_pretrained(model_dir)


def speakers(talker_config: Any) -> Speakers:
    """The voices of the talker config's ``speaker_id`` map (``{name: codec id}``, lower-case names)."""
    ids: dict[str, int] = dict(talker_config.speaker_id or {})
    if not ids:
        raise RuntimeError("the talker config names no speakers (talker_config.speaker_id)")
    return Speakers(
        entries={name.capitalize(): {"codec_id": int(i)} for name, i in ids.items()}, preferred=DEFAULT_VOICE
    )


_conversion_lock = threading.Lock()


def fused_experts_loading(cls: type) -> None:
    """Make ``cls.from_pretrained`` fuse the checkpoint's per-expert MoE weights (``experts.<i>.gate_proj``
    ...) as the whole model's loading does. transformers 5.19 registers that conversion for the whole model
    and the thinker but not for the talker loaded alone, which then reports its experts' weights missing."""
    from transformers.conversion_mapping import (  # noqa: PLC0415  (only this loader needs them)
        get_checkpoint_conversion_mapping,
        register_checkpoint_conversion_mapping,
    )

    with _conversion_lock:
        if get_checkpoint_conversion_mapping(cls.__name__) is None:
            register_checkpoint_conversion_mapping(cls.__name__, get_checkpoint_conversion_mapping("qwen3_omni_moe"))


def lend_audio_config(talker: Any, config: Any) -> None:
    """Give ``talker`` (a ``Qwen3OmniMoeTalkerForConditionalGeneration``) the thinker's audio encoder config.

    transformers 5.19's M-RoPE index, which the talker shares with the thinker, counts each audio's tokens
    with ``self.config.audio_config.n_window``; the talker's config has no ``audio_config``, so a prompt with
    audio and an image or a video (a video's own track included) fails there, in the whole model's
    ``generate()`` as well. The count it needs is the thinker's (its audio encoder made those tokens), so the
    talker reads the thinker's config, as the whole model does once given the same (the tests' reference)."""
    if not hasattr(talker.config, "audio_config"):
        talker.config.audio_config = config.thinker_config.audio_config


def moe_experts(engine: OmniEngine, model: Any) -> None:
    """``engine_args.moe``: ``grouped`` (the default on accelerators) runs ``model``'s experts through
    grouped products (:mod:`..moe`), ``loop`` keeps transformers' loop over experts, which is the default on
    CPU, where the tests compare the stages with the whole model bit for bit (the grouped products round
    within float32's last bits of it)."""
    default = "grouped" if torch.device(engine.device).type != "cpu" else "loop"
    choice = str(engine.args.get("moe", default))
    if choice not in ("grouped", "loop"):
        raise ValueError(f"engine_args.moe must be grouped or loop, not {choice!r}")
    if choice == "grouped":
        count = use_grouped_experts(model)
        log.info("Stage %s: %d mixture-of-experts layers through grouped products", engine.stage.name, count)
