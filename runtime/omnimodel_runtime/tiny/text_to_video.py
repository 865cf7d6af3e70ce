"""The tiny model of the ``text-to-video`` preset: a random-weight diffusers ``WanPipeline`` in Wan2.2's
text-to-video layout.

Real classes throughout — ``UMT5EncoderModel`` text encoder, two ``WanTransformer3DModel`` experts
(``transformer`` for the high-noise steps, ``transformer_2`` for the low-noise ones, switched at
``boundary_ratio`` as Wan2.2-T2V-A14B does), the Wan ``AutoencoderKLWan`` (8x spatial, 4x temporal
compression, so a video has ``4k + 1`` frames) and ``UniPCMultistepScheduler`` with flow sigmas — at the
sizes diffusers' own Wan tests use, saved with ``save_pretrained`` so the engine loads it with
``from_pretrained`` as it would a real checkpoint. Built in a few seconds on a CPU.

The tokenizer is a byte-level BPE trained here (UMT5's sentencepiece model would be a download); the
pipeline only needs ids, padding and a mask from it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Final

import torch
from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
from diffusers.utils import logging as diffusers_logging
from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel
from transformers.utils import logging as hf_logging

from omnimodel_runtime.tiny.text import byte_level_bpe

PAD: Final = "<pad>"
EOS: Final = "</s>"
UNK: Final = "<unk>"
VOCAB_SIZE: Final = 512
# Wan2.2-T2V-A14B switches from the high-noise to the low-noise expert at 0.875 of the training timesteps.
BOUNDARY_RATIO: Final = 0.875

_WORDS: Final = (
    "a an the of with on in under over and red green blue white black cat dog fox bird horse robot city "
    "forest river ocean beach sky sun moon cloud rain snow tree flower car train boat walking running "
    "flying dancing slowly quickly camera pans zooms close wide shot night morning sunset"
)

TEXT_ENCODER: Final[dict[str, Any]] = {
    "d_model": 32,
    "d_kv": 8,
    "d_ff": 32,
    "num_layers": 2,
    "num_heads": 4,
    "relative_attention_num_buckets": 8,
}
# diffusers' tests/pipelines/wan sizes; text_dim is the text encoder's d_model.
TRANSFORMER: Final[dict[str, Any]] = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 2,
    "attention_head_dim": 12,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 32,
    "freq_dim": 256,
    "ffn_dim": 32,
    "num_layers": 2,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    # Wan2.2's own (diffusers' tests use 32, which fits no default or OpenAI size: 832 pixels are 52 patches).
    "rope_max_seq_len": 1024,
}
VAE: Final[dict[str, Any]] = {
    "base_dim": 3,
    "z_dim": 16,
    "dim_mult": [1, 1, 1, 1],
    "num_res_blocks": 1,
    "temperal_downsample": [False, True, True],
}
# Wan's released schedulers: UniPC over flow-matching sigmas with a fixed shift.
SCHEDULER: Final[dict[str, Any]] = {
    "prediction_type": "flow_prediction",
    "use_flow_sigmas": True,
    "num_train_timesteps": 1000,
    "flow_shift": 3.0,
}


def build_tokenizer(seed: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE with T5's special tokens (``<pad>`` first: id 0, as UMT5's)."""
    rng = random.Random(seed)  # noqa: S311  (reproducible filler text, not secrets)
    pool = _WORDS.split()
    corpus = [" ".join(rng.choice(pool) for _ in range(rng.randint(2, 12))) for _ in range(1000)]
    return byte_level_bpe(
        corpus,
        vocab_size=VOCAB_SIZE,
        special_tokens=(PAD, EOS, UNK),
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=512,
        padding_side="right",
    )


def text_side(seed: int) -> tuple[PreTrainedTokenizerFast, UMT5EncoderModel]:
    """The tokenizer and the UMT5 text encoder every tiny Wan pipeline shares, with progress bars off.
    Seeded before the encoder: module initialisers draw from the global RNG, and each part must come out
    the same whatever the others are."""
    hf_logging.disable_progress_bar()
    diffusers_logging.disable_progress_bar()
    tokenizer = build_tokenizer(seed)
    config = UMT5Config(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
        **TEXT_ENCODER,
    )
    torch.manual_seed(seed)
    return tokenizer, UMT5EncoderModel(config).eval()


def build(out: Path, *, seed: int) -> None:
    """Write a random-weight Wan2.2-layout ``WanPipeline`` into ``out``."""
    tokenizer, text_encoder = text_side(seed)
    # Seeded before each part (see text_side); the two experts get different seeds so they differ.
    torch.manual_seed(seed)
    transformer = WanTransformer3DModel(**TRANSFORMER)
    torch.manual_seed(seed + 1)
    transformer_2 = WanTransformer3DModel(**TRANSFORMER)
    torch.manual_seed(seed)
    vae = AutoencoderKLWan(**VAE)
    pipe = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=UniPCMultistepScheduler(**SCHEDULER),
        transformer=transformer,
        transformer_2=transformer_2,
        boundary_ratio=BOUNDARY_RATIO,
    )
    pipe.save_pretrained(out)
    (out / "README.md").write_text(
        f"Random-weight WanPipeline (Wan2.2 text-to-video layout, tiny) built by `omnimodel make-tiny --preset "
        f"text-to-video` (seed {seed}). Not a trained model: its videos are noise.\n"
    )
    (out / "omnimodel-build.json").write_text(json.dumps({"preset": "text-to-video", "seed": seed}) + "\n")
