"""A tiny random-weight Wan2.2 TI2V-5B (diffusers ``WanPipeline``) for vLLM-Omni's ``wan2_2_ti2v`` config.

The ``text-to-video`` preset has Wan2.2-T2V-A14B's layout (two experts, the 16-channel Wan2.1 VAE);
``wan2_2_ti2v`` is TI2V-5B's, which vLLM-Omni 0.30 tells apart by the checkpoint itself
(``diffusion/models/wan2_2/pipeline_wan2_2.py``): ``expand_timesteps: true`` in ``model_index.json`` (one
timestep per latent patch, so a first frame can be kept clean) and no ``transformer_2`` folder (one
expert). So this preset keeps what that code reads:

- one ``WanTransformer3DModel`` with 48 latent channels in and out and ``patch_size (1, 2, 2)``;
- the Wan2.2 VAE (``is_residual``, ``z_dim`` 48, pixels folded 2×2 into 12 channels, 16× spatial and 4×
  temporal compression, so sizes snap to multiples of 32 and a video has ``4k + 1`` frames);
- ``expand_timesteps: true`` in the pipeline.

Sizes are diffusers' own Wan2.2-5B test sizes, the text encoder and tokenizer the ``text-to-video``
preset's. Built in seconds on a CPU; its videos are noise.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Final

import torch
from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel

from omnimodel_runtime.tiny.text_to_video import SCHEDULER, TRANSFORMER, text_side

PRESET: Final = "text-to-video-ti2v-vllm-omni"
LATENT_CHANNELS: Final = 48
# TI2V-5B's transformer: the text-to-video preset's sizes with the 48-channel latent.
TI2V_TRANSFORMER: Final[dict[str, Any]] = {
    **TRANSFORMER,
    "in_channels": LATENT_CHANNELS,
    "out_channels": LATENT_CHANNELS,
}
# The Wan2.2 VAE (diffusers' Wan2.2-5B test sizes): 2x2 pixel patches folded into 12 channels, residual
# blocks, 48 latent channels, 16x spatial compression in all.
TI2V_VAE: Final[dict[str, Any]] = {
    "base_dim": 3,
    "z_dim": LATENT_CHANNELS,
    "in_channels": 12,
    "out_channels": 12,
    "is_residual": True,
    "patch_size": 2,
    "latents_mean": [0.0] * LATENT_CHANNELS,
    "latents_std": [1.0] * LATENT_CHANNELS,
    "dim_mult": [1, 1, 1, 1],
    "num_res_blocks": 1,
    "scale_factor_spatial": 16,
    "scale_factor_temporal": 4,
    "temperal_downsample": [False, True, True],
}


def build(out: Path, *, seed: int) -> None:
    """Write a random-weight Wan2.2 TI2V-5B-layout ``WanPipeline`` into ``out``."""
    tokenizer, text_encoder = text_side(seed)
    # Seeded before each part (see text_side).
    torch.manual_seed(seed)
    transformer = WanTransformer3DModel(**TI2V_TRANSFORMER)
    torch.manual_seed(seed)
    vae = AutoencoderKLWan(**TI2V_VAE)
    pipe = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=UniPCMultistepScheduler(**SCHEDULER),
        transformer=transformer,
        expand_timesteps=True,
    )
    pipe.save_pretrained(out)
    (out / "README.md").write_text(
        f"Random-weight WanPipeline (Wan2.2 TI2V-5B layout, tiny) built by `omnimodel make-tiny --preset "
        f"{PRESET}` (seed {seed}). Not a trained model: its videos are noise.\n"
    )
    (out / "omnimodel-build.json").write_text(json.dumps({"preset": PRESET, "seed": seed}) + "\n")
