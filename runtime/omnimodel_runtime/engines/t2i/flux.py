"""The FLUX family: ``FluxPipeline`` (FLUX.1 dev/schnell and fine-tunes)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from omnimodel_runtime.engines.t2i.family import Conditioning, Family, encode_kwargs, to_uint8


class FluxFamily(Family):
    """``FluxPipeline``: CLIP (pooled) + T5 (sequence, always padded to ``max_sequence_length``, so no
    mask), MMDiT transformer, 2-D VAE with scaling and shift factors."""

    pipeline_class = "FluxPipeline"

    def vae_scale_factor(self, vae_config: Mapping[str, Any]) -> int:
        return int(2 ** (len(vae_config["block_out_channels"]) - 1))

    def encode(
        self, pipe: Any, prompt: str, negative_prompt: str | None, max_sequence_length: int, image: Any = None
    ) -> Conditioning:
        kwargs = encode_kwargs(pipe, max_sequence_length)
        embeds, pooled, _ = pipe.encode_prompt(prompt=prompt, prompt_2=None, **kwargs)
        tensors = {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}
        if negative_prompt is not None:
            neg, neg_pooled, _ = pipe.encode_prompt(prompt=negative_prompt, prompt_2=None, **kwargs)
            tensors |= {"negative_prompt_embeds": neg, "negative_pooled_prompt_embeds": neg_pooled}
        return Conditioning(tensors=tensors, prompt_tokens=int(embeds.shape[1]))

    def decode(self, pipe: Any, latents: torch.Tensor, height: int, width: int) -> np.ndarray:
        vae = pipe.vae
        latents = pipe._unpack_latents(latents.to(vae.device), height, width, pipe.vae_scale_factor)
        latents = (latents / vae.config.scaling_factor) + vae.config.shift_factor
        image = vae.decode(latents.to(vae.dtype), return_dict=False)[0]
        return to_uint8(pipe, image)

    def dummy_conditioning(self, pipe: Any, condition: tuple[int, int] | None = None) -> Conditioning:
        config, ref = pipe.transformer.config, pipe.transformer
        embeds = torch.zeros((1, 4, config.joint_attention_dim), dtype=ref.dtype, device=ref.device)
        pooled = torch.zeros((1, config.pooled_projection_dim), dtype=ref.dtype, device=ref.device)
        return Conditioning(tensors={"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}, prompt_tokens=4)

    def latent_channels(self, pipe: Any) -> int:
        return int(pipe.vae.config.latent_channels)
