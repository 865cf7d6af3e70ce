"""The tiny model of the ``text-to-image`` preset: a random-weight diffusers ``QwenImagePipeline``.

Real classes throughout — Qwen2.5-VL text encoder, ``QwenImageTransformer2DModel``, ``AutoencoderKLQwenImage``,
``FlowMatchEulerDiscreteScheduler`` — at the sizes diffusers' own tests use, saved with
``save_pretrained`` so every stage loads it (or only its part of it) with ``from_pretrained``, as it would
a real checkpoint.

The tokenizer is a byte-level BPE trained here, so nothing is downloaded. ``QwenImagePipeline`` drops a
fixed 34-token prefix (its prompt template's system turn) from the text encoder's output, so the
template is in the training corpus often enough that each of its words is one token, and the build
checks that the prefix really is 34 tokens.

Random weights make the prompt's effect on the image faint (the text stream is normalised in every block
and is a few tokens beside the image's); the transformer's text keys and values are scaled up so that
different prompts give visibly different images, which is what tests of request batching need to tell
requests apart.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Final

import torch
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from diffusers.utils import logging as diffusers_logging
from transformers import PreTrainedTokenizerFast, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
from transformers.utils import logging as hf_logging

from omnimodel_runtime.tiny.text import byte_level_bpe

ENDOFTEXT: Final = "<|endoftext|>"
IM_START: Final = "<|im_start|>"
IM_END: Final = "<|im_end|>"
VISION: Final = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
SPECIAL_TOKENS: Final = (ENDOFTEXT, IM_START, IM_END, *VISION)
VOCAB_SIZE: Final = 1024
TEMPLATE_PREFIX_TOKENS: Final = 34

_WORD_TEXT: Final = (
    "a an the of with on in under over beside and or red green blue yellow black white orange purple "
    "cat dog fox bird horse fish dragon robot astronaut city forest mountain river ocean beach desert "
    "sky sun moon star cloud rain snow tree flower house castle car train boat bicycle lamp cup book "
    "small large tiny huge old new bright dark shiny soft wooden glass metal stone painting photo "
    "sketch watercolor night morning sunset portrait landscape close up wide view dance monkey sign "
    "holding says hello world bad quality blurry low ugly distorted"
)

# Architectures by size. "tiny" is what tests and the demo run (diffusers' test sizes). The others are
# Qwen-Image's published architecture for benchmarks on accelerators, where random weights cost the same
# compute as trained ones (DESIGN section 8): "qwen-image" is the whole 60-block transformer with the
# Qwen2.5-VL-7B text encoder; "qwen-image-20l" keeps every shape but 20 of the 60 transformer blocks
# (per-step work and launch pattern of each block unchanged, a third of the weights to write and load).
# Real sizes keep the real vocabulary width; the vision tower, which text-to-image never runs, is cut to
# two blocks.
_QWEN_TEXT_7B: Final[dict[str, Any]] = {
    "vocab_size": 152064,
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "rope_scaling": {"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"},
    "rope_theta": 1000000.0,
    "max_position_embeddings": 128000,
}
_QWEN_VISION_STUB: Final[dict[str, Any]] = {
    "depth": 2,
    "hidden_size": 1280,
    "intermediate_size": 3420,
    "num_heads": 16,
    "out_hidden_size": 3584,
}
SIZES: Final[dict[str, dict[str, Any]]] = {
    "tiny": {
        "dtype": "float32",
        "text": {
            "hidden_size": 16,
            "intermediate_size": 16,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
            "rope_theta": 1000000.0,
        },
        "vision": {"depth": 2, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 16},
        "transformer": {
            "patch_size": 2,
            "in_channels": 16,
            "out_channels": 4,
            "num_layers": 2,
            "attention_head_dim": 16,
            "num_attention_heads": 3,
            "joint_attention_dim": 16,
            "guidance_embeds": False,
            "axes_dims_rope": (8, 4, 4),
        },
        "vae": {
            "base_dim": 24,
            "z_dim": 4,
            "dim_mult": [1, 2, 4],
            "num_res_blocks": 1,
            "temperal_downsample": [False, True],
            "latents_mean": [0.0] * 4,
            "latents_std": [1.0] * 4,
        },
        # Gain on the text stream's attention values (keys get its square root); see the module docstring.
        "text_gain": 16.0,
    },
    "qwen-image": {
        "dtype": "bfloat16",
        "text": _QWEN_TEXT_7B,
        "vision": _QWEN_VISION_STUB,
        "transformer": {},
        "vae": {},
    },
    "qwen-image-20l": {
        "dtype": "bfloat16",
        "text": _QWEN_TEXT_7B,
        "vision": _QWEN_VISION_STUB,
        "transformer": {"num_layers": 20},
        "vae": {},
    },
}

# Modelled on Qwen-Image's released scheduler configuration (resolution-dependent shift).
SCHEDULER: Final[dict[str, Any]] = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 8192,
    "max_shift": 0.9,
    "shift": 1.0,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
    "use_dynamic_shifting": True,
}

TEMPLATE: Final = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def _corpus(seed: int, template: str = TEMPLATE, lines: int = 3000) -> list[str]:
    """Prompts in the pipeline's template (so the template's words become single tokens) and plain text."""
    rng = random.Random(seed)  # noqa: S311  (reproducible filler text, not secrets)
    pool = _WORD_TEXT.split()
    out: list[str] = []
    for i in range(lines):
        words = " ".join(rng.choice(pool) for _ in range(rng.randint(2, 14)))
        if rng.random() < 0.2:
            words += f" {rng.randint(0, 9999)}"
        out.append(template.format(words) if i % 2 == 0 else words[0].upper() + words[1:] + ".")
    return out


def build_tokenizer(
    seed: int,
    *,
    template: str = TEMPLATE,
    prefix_tokens: int = TEMPLATE_PREFIX_TOKENS,
    pipeline: str = "QwenImagePipeline",
) -> PreTrainedTokenizerFast:
    """Byte-level BPE (every byte encodable) with Qwen's special tokens; right padding as Qwen2's. The
    part of ``template`` before its first placeholder (``{}`` or the image) must come out as exactly
    ``prefix_tokens`` tokens: ``pipeline`` drops that many from the text encoder's output."""
    wrapped = byte_level_bpe(
        _corpus(seed, template),
        vocab_size=VOCAB_SIZE,
        special_tokens=tuple(SPECIAL_TOKENS),
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        model_max_length=32768,
        padding_side="right",
    )
    prefix = template.split("{}", 1)[0].split("<|vision_start|>", 1)[0]
    count = len(wrapped(prefix).input_ids)
    if count != prefix_tokens:
        raise RuntimeError(
            f"the tokenizer splits the prompt template's prefix into {count} tokens; {pipeline} "
            f"drops exactly {prefix_tokens}"
        )
    return wrapped


def build(out: Path, *, seed: int, size: str = "tiny", device: str = "cpu") -> None:
    """Write a random-weight ``QwenImagePipeline`` (``size`` from :data:`SIZES`) into ``out``.
    ``device`` only speeds up initialising the large sizes."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r} for preset text-to-image (known: {', '.join(SIZES)})")
    arch = SIZES[size]
    # Progress bars per saved shard are noise in build logs.
    hf_logging.disable_progress_bar()
    diffusers_logging.disable_progress_bar()
    tokenizer = build_tokenizer(seed)
    text_encoder, transformer, vae = build_modules(arch, tokenizer, seed=seed, device=device)
    scheduler = FlowMatchEulerDiscreteScheduler(**SCHEDULER)
    pipe = QwenImagePipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer
    )
    pipe.save_pretrained(out)
    (out / "README.md").write_text(
        f"Random-weight QwenImagePipeline ({size}) built by `omnimodel make-tiny --preset text-to-image` "
        f"(seed {seed}). Not a trained model: its images are noise.\n"
    )
    (out / "omnimodel-build.json").write_text(
        json.dumps({"preset": "text-to-image", "seed": seed, "size": size}) + "\n"
    )


def build_modules(
    arch: dict[str, Any], tokenizer: PreTrainedTokenizerFast, *, seed: int, device: str = "cpu"
) -> tuple[Any, Any, Any]:
    """The random-weight text encoder, transformer and VAE of one :data:`SIZES` entry."""
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text = dict(arch["text"])
    vocab_size = int(text.pop("vocab_size", len(tokenizer)))
    text_config = {
        **text,
        "vocab_size": vocab_size,
        "bos_token_id": ids[ENDOFTEXT],
        "eos_token_id": ids[IM_END],
        "pad_token_id": ids[ENDOFTEXT],
    }
    config = Qwen2_5_VLConfig(
        text_config=text_config,
        vision_config=dict(arch["vision"]),
        vocab_size=vocab_size,
        bos_token_id=ids[ENDOFTEXT],
        eos_token_id=ids[IM_END],
        pad_token_id=ids[ENDOFTEXT],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
    )
    dtype = getattr(torch, arch["dtype"])
    # Seed the global RNG before each part: module initialisers draw from it, and the same seed must
    # give the same bytes whatever the other parts' sizes. Modules are built in float32 (as
    # from_pretrained computes their buffers) and cast afterwards, each before the next is built. On a
    # GPU the transformer is built in its dtype: Qwen-Image's 20 B parameters in float32 (82 GB) do not
    # fit an 80 GB card (its rotary tables are float32 either way: diffusers computes them so).
    with torch.device(device):
        torch.manual_seed(seed)
        text_encoder = Qwen2_5_VLForConditionalGeneration(config).eval().to(dtype)
        torch.manual_seed(seed)
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype if torch.device(device).type == "cuda" else torch.float32)
        try:
            transformer = QwenImageTransformer2DModel(**arch["transformer"]).to(dtype)
        finally:
            torch.set_default_dtype(default)
        torch.manual_seed(seed)
        vae = AutoencoderKLQwenImage(**arch["vae"]).to(dtype)
    gain = float(arch.get("text_gain", 1.0))
    if gain != 1.0:
        with torch.no_grad():
            for block in transformer.transformer_blocks:
                block.attn.add_v_proj.weight.mul_(gain)
                block.attn.add_k_proj.weight.mul_(gain**0.5)
    return text_encoder, transformer, vae
