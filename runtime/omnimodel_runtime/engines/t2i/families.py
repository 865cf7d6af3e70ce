"""How a diffusers text-to-image pipeline splits into encode → denoise → decode.

Every DiT pipeline in diffusers exposes the same three hooks, which is what lets one engine serve it
whole or split:

1. ``pipe.encode_prompt(...)`` turns a prompt into embeddings (and, for some families, masks or pooled
   vectors) — the encode stage, which loads only the text encoder(s) and tokenizer(s);
2. ``pipe(prompt_embeds=..., generator=[...], output_type="latent")`` runs the transformer and scheduler
   on those embeddings and returns the final latents — the denoise stage, which loads only the transformer
   and scheduler;
3. the tail of ``pipe.__call__`` (unpack, de-normalise, ``vae.decode``, ``image_processor.postprocess``)
   — the decode stage, which loads only the VAE.

What differs between families is the names of the embedding tensors, which of them are variable-length
(and so need padding and a mask to batch requests of different prompt lengths), and how latents are
unpacked and de-normalised; a :class:`Family` says exactly that. Covered here: ``QwenImagePipeline``
(Qwen-Image and its fine-tunes) and ``FluxPipeline`` (FLUX.1 dev/schnell and fine-tunes).

Facts the split must respect (see docs/reference/PIPELINE-NOTES.md): latents come back *packed* ``(B, tokens, C)``, so
decode needs the image size; a pipeline loaded without its VAE assumes ``vae_scale_factor = 8``, so the
factor is set from the VAE's config; Qwen-Image masks become ``None`` when all ones, and only the
denoise stage uses the seed.
"""

from __future__ import annotations

import abc
import inspect
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Final

import numpy as np
import torch

ENCODE_COMPONENTS: Final = ("text_encoder", "tokenizer")
DENOISE_COMPONENTS: Final = ("transformer", "scheduler")
DECODE_COMPONENTS: Final = ("vae",)


@dataclass(frozen=True)
class PipelineDefaults:
    """What a request that leaves a parameter unset gets, and what sizes the model accepts."""

    width: int
    height: int
    # Both sides must be multiples of this (VAE downsampling × the transformer's patch size).
    multiple: int
    steps: int
    true_cfg_scale: float
    guidance_scale: float | None
    # A guidance-distilled transformer takes ``guidance_scale`` as an input; others ignore it.
    guidance_distilled: bool
    # Prompt tokens the pipeline keeps (``__call__``'s default); encode truncates to it as the pipeline does.
    max_sequence_length: int
    # Fewest steps the scheduler can run: a flow-matching schedule with a terminal shift (Qwen-Image's)
    # stretches ``1 - sigma`` to end at ``shift_terminal``, dividing by zero for one step (the image is
    # all NaN, then black); without one a single step is valid (FLUX schnell).
    min_steps: int = 1


@dataclass(frozen=True)
class Conditioning:
    """One request's encoded prompt(s): positive tensors and, with classifier-free guidance, negative."""

    tensors: Mapping[str, torch.Tensor]
    prompt_tokens: int


class Family(abc.ABC):
    """The split of one diffusers pipeline class."""

    pipeline_class: ClassVar[str]
    # Embedding tensors of variable length → the name of their mask: rows of different lengths are
    # right-padded with zeros and masked, which is what the pipeline itself does for a list of prompts.
    masked: ClassVar[Mapping[str, str]] = {}
    # Whether :meth:`merge_guidance` can run both guidance branches as one transformer call.
    batches_guidance: ClassVar[bool] = False

    # ------------------------------------------------------------ loading

    def components(self, names: Sequence[str], role: str) -> set[str]:
        """Which of the pipeline's components a stage of ``role`` loads (the rest load as ``None``)."""
        prefixes = {
            "encode": ENCODE_COMPONENTS,
            "denoise": DENOISE_COMPONENTS,
            "decode": DECODE_COMPONENTS,
        }.get(role)
        if prefixes is None:  # the whole pipeline in one stage
            return set(names)
        return {n for n in names if n.startswith(prefixes)}

    @abc.abstractmethod
    def vae_scale_factor(self, vae_config: Mapping[str, Any]) -> int:
        """Pixels per latent cell, as the pipeline computes it from its VAE."""

    def patch_size(self) -> int:
        """Latent cells per transformer token along each side (packing)."""
        return 2

    def configure(self, pipe: Any, model_dir: Path) -> None:
        """Make a partially loaded pipeline behave like the whole one (its VAE-derived factors)."""
        factor = self.vae_scale_factor(read_config(model_dir / "vae" / "config.json"))
        if getattr(pipe, "vae", None) is None and getattr(pipe, "vae_scale_factor", None) != factor:
            from diffusers.image_processor import VaeImageProcessor  # noqa: PLC0415

            pipe.vae_scale_factor = factor
            pipe.image_processor = VaeImageProcessor(vae_scale_factor=factor * self.patch_size())

    def defaults(self, pipe_class: type[Any], model_dir: Path) -> PipelineDefaults:
        """Defaults of ``pipe_class.__call__`` and the model's native size, read from config files only
        (every stage can validate a request, whatever components it loaded)."""
        call = inspect.signature(pipe_class.__call__).parameters
        factor = self.vae_scale_factor(read_config(model_dir / "vae" / "config.json"))
        transformer = read_config(model_dir / "transformer" / "config.json")
        native = self.default_sample_size(transformer) * factor
        guidance = call["guidance_scale"].default if "guidance_scale" in call else None
        return PipelineDefaults(
            width=native,
            height=native,
            multiple=factor * self.patch_size(),
            steps=int(call["num_inference_steps"].default),
            true_cfg_scale=float(call["true_cfg_scale"].default) if "true_cfg_scale" in call else 1.0,
            guidance_scale=None if guidance is None else float(guidance),
            guidance_distilled=bool(transformer.get("guidance_embeds", False)),
            max_sequence_length=int(call["max_sequence_length"].default),
            min_steps=2 if _scheduler_config(model_dir).get("shift_terminal") else 1,
        )

    def default_sample_size(self, transformer_config: Mapping[str, Any]) -> int:
        return 128

    # ------------------------------------------------------------ the three stages

    @abc.abstractmethod
    def encode(self, pipe: Any, prompt: str, negative_prompt: str | None, max_sequence_length: int) -> Conditioning:
        """Embed one prompt (and the negative one when guidance is on), one row each."""

    def batch(self, items: Sequence[tuple[Conditioning, int]], device: Any) -> dict[str, torch.Tensor]:
        """The embedding arguments of one ``pipe(...)`` call for several requests: each request's rows
        repeated for its ``n`` images (as ``num_images_per_prompt`` would), variable-length ones padded
        and masked. Masks are always passed (all ones when nothing is padded): the pipeline drops an
        all-ones mask itself, so the computation is the one it does for a single prompt."""
        names = list(items[0][0].tensors)
        mask_names = set(self.masked.values())
        out: dict[str, torch.Tensor] = {}
        for name in names:
            if name in mask_names:
                continue
            rows = [(c.tensors[name].to(device), c.tensors.get(self.masked.get(name, "")), n) for c, n in items]
            if name not in self.masked:
                out[name] = torch.cat([t.repeat_interleave(n, dim=0) for t, _, n in rows])
                continue
            out[name], out[self.masked[name]] = pad_and_mask(
                [
                    (t.repeat_interleave(n, dim=0), None if m is None else m.repeat_interleave(n, dim=0))
                    for t, m, n in rows
                ],
                device,
            )
        return out

    def merge_guidance(self, positive: Mapping[str, Any], negative: tuple[Any, ...]) -> dict[str, Any] | None:
        """The transformer kwargs of one call on ``[positive; negative]`` rows (``cfg_batch``), from the
        pipeline's positive call and its ``encode_prompt`` result for the negative prompt; ``None`` where
        this family cannot merge them (the call then runs as the pipeline makes it)."""
        return None

    def guidance_kwargs(self, *, cfg: bool, true_cfg_scale: float, guidance_scale: float | None) -> dict[str, Any]:
        """``true_cfg_scale``/``guidance_scale`` arguments of the denoise call."""
        return {"true_cfg_scale": true_cfg_scale if cfg else 1.0, "guidance_scale": guidance_scale}

    @abc.abstractmethod
    def decode(self, pipe: Any, latents: torch.Tensor, height: int, width: int) -> np.ndarray:
        """Packed latents of ``n`` images → ``(n, height, width, 3)`` uint8, exactly the pixels the
        whole pipeline's PIL output has."""

    # ------------------------------------------------------------ warm-up inputs

    @abc.abstractmethod
    def dummy_conditioning(self, pipe: Any) -> Conditioning:
        """Zero embeddings of the right shapes (warms up a denoise stage without a text encoder)."""

    def dummy_latents(self, pipe: Any, height: int, width: int) -> torch.Tensor:
        """Zero packed latents for one image (warms up a decode stage without a transformer)."""
        factor, patch = pipe.vae_scale_factor, self.patch_size()
        tokens = (height // (factor * patch)) * (width // (factor * patch))
        channels = self.latent_channels(pipe) * patch * patch
        return torch.zeros((1, tokens, channels), dtype=pipe.vae.dtype, device=pipe.vae.device)

    @abc.abstractmethod
    def latent_channels(self, pipe: Any) -> int:
        """Channels of one unpacked latent cell."""


def pad_and_mask(
    rows: Sequence[tuple[torch.Tensor, torch.Tensor | None]], device: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Variable-length embedding rows ``(batch, tokens, dim)`` with their masks (``None``: all valid) as one
    batch: right-padded with zeros to the longest, the padding masked out — what the pipeline does for a
    list of prompts."""
    width = max(t.shape[1] for t, _ in rows)
    embeds, masks = [], []
    for t, mask in rows:
        pad = width - t.shape[1]
        m = torch.ones(t.shape[:2], dtype=torch.long, device=device) if mask is None else mask.to(device)
        embeds.append(torch.nn.functional.pad(t.to(device), (0, 0, 0, pad)))
        masks.append(torch.nn.functional.pad(m.long(), (0, pad)))
    return torch.cat(embeds), torch.cat(masks)


def _to_uint8(pipe: Any, image: torch.Tensor) -> np.ndarray:
    """``postprocess`` to floats, then the same rounding diffusers' ``numpy_to_pil`` applies (a NaN, which
    some schedules produce at one step, becomes black instead of an undefined cast)."""
    floats = np.nan_to_num(pipe.image_processor.postprocess(image, output_type="np"), nan=0.0)
    return np.asarray((floats * 255).round().astype(np.uint8))


class QwenImageFamily(Family):
    """``QwenImagePipeline``: Qwen2.5-VL text encoder (last hidden state after a 34-token template
    prefix, variable length with a mask), MMDiT transformer, Wan-style 3-D VAE with per-channel
    latent mean/std."""

    pipeline_class = "QwenImagePipeline"
    batches_guidance: ClassVar[bool] = True
    masked: ClassVar[Mapping[str, str]] = {
        "prompt_embeds": "prompt_embeds_mask",
        "negative_prompt_embeds": "negative_prompt_embeds_mask",
    }

    def vae_scale_factor(self, vae_config: Mapping[str, Any]) -> int:
        return int(2 ** len(vae_config["temperal_downsample"]))

    def encode(self, pipe: Any, prompt: str, negative_prompt: str | None, max_sequence_length: int) -> Conditioning:
        kwargs = {
            "device": pipe._execution_device,
            "num_images_per_prompt": 1,
            "max_sequence_length": max_sequence_length,
        }
        tensors: dict[str, torch.Tensor] = {}
        embeds, mask = pipe.encode_prompt(prompt=prompt, **kwargs)
        tensors["prompt_embeds"] = embeds
        if mask is not None:
            tensors["prompt_embeds_mask"] = mask
        if negative_prompt is not None:
            neg, neg_mask = pipe.encode_prompt(prompt=negative_prompt, **kwargs)
            tensors["negative_prompt_embeds"] = neg
            if neg_mask is not None:
                tensors["negative_prompt_embeds_mask"] = neg_mask
        return Conditioning(tensors=tensors, prompt_tokens=int(embeds.shape[1]))

    def decode(self, pipe: Any, latents: torch.Tensor, height: int, width: int) -> np.ndarray:
        vae = pipe.vae
        latents = pipe._unpack_latents(latents.to(vae.device), height, width, pipe.vae_scale_factor).to(vae.dtype)
        z = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
        latents = latents / inv_std + mean
        image = vae.decode(latents, return_dict=False)[0][:, :, 0]
        return _to_uint8(pipe, image)

    # What a Qwen-Image transformer call may carry; a call with anything else is not merged.
    _CALL_KEYS: ClassVar[frozenset[str]] = frozenset(
        {
            "hidden_states",
            "timestep",
            "guidance",
            "encoder_hidden_states",
            "encoder_hidden_states_mask",
            "img_shapes",
            "attention_kwargs",
            "return_dict",
        }
    )

    def merge_guidance(self, positive: Mapping[str, Any], negative: tuple[Any, ...]) -> dict[str, Any] | None:
        if not set(positive) <= self._CALL_KEYS or len(negative) != 2:
            return None
        embeds, mask = positive["encoder_hidden_states"], positive.get("encoder_hidden_states_mask")
        neg_embeds, neg_mask = negative
        latents, img_shapes = positive["hidden_states"], positive.get("img_shapes")
        if neg_embeds.shape[0] != embeds.shape[0] or not isinstance(img_shapes, list):
            return None
        merged = dict(positive)
        if embeds.shape[1] == neg_embeds.shape[1] and mask is None and neg_mask is None:
            # Nothing to pad: no mask either, so attention takes the same unmasked path as the two calls.
            merged["encoder_hidden_states"] = torch.cat([embeds, neg_embeds])
            merged["encoder_hidden_states_mask"] = None
        else:
            # The transformer builds the joint attention mask from this one (diffusers 0.42): padded
            # text tokens are never attended to, and right-padding keeps every real token's RoPE position.
            both, both_mask = pad_and_mask([(embeds, mask), (neg_embeds, neg_mask)], embeds.device)
            merged["encoder_hidden_states"] = both
            merged["encoder_hidden_states_mask"] = both_mask
        merged["hidden_states"] = torch.cat([latents, latents])
        merged["timestep"] = torch.cat([positive["timestep"], positive["timestep"]])
        if positive.get("guidance") is not None:
            merged["guidance"] = torch.cat([positive["guidance"], positive["guidance"]])
        merged["img_shapes"] = img_shapes + img_shapes
        return merged

    def dummy_conditioning(self, pipe: Any) -> Conditioning:
        transformer = pipe.transformer
        embeds = torch.zeros(
            (1, 4, transformer.config.joint_attention_dim), dtype=transformer.dtype, device=transformer.device
        )
        return Conditioning(tensors={"prompt_embeds": embeds}, prompt_tokens=4)

    def latent_channels(self, pipe: Any) -> int:
        return int(pipe.vae.config.z_dim)


class FluxFamily(Family):
    """``FluxPipeline``: CLIP (pooled) + T5 (sequence, always padded to ``max_sequence_length``, so no
    mask), MMDiT transformer, 2-D VAE with scaling and shift factors."""

    pipeline_class = "FluxPipeline"

    def vae_scale_factor(self, vae_config: Mapping[str, Any]) -> int:
        return int(2 ** (len(vae_config["block_out_channels"]) - 1))

    def encode(self, pipe: Any, prompt: str, negative_prompt: str | None, max_sequence_length: int) -> Conditioning:
        kwargs = {
            "device": pipe._execution_device,
            "num_images_per_prompt": 1,
            "max_sequence_length": max_sequence_length,
        }
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
        return _to_uint8(pipe, image)

    def dummy_conditioning(self, pipe: Any) -> Conditioning:
        config, ref = pipe.transformer.config, pipe.transformer
        embeds = torch.zeros((1, 4, config.joint_attention_dim), dtype=ref.dtype, device=ref.device)
        pooled = torch.zeros((1, config.pooled_projection_dim), dtype=ref.dtype, device=ref.device)
        return Conditioning(tensors={"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}, prompt_tokens=4)

    def latent_channels(self, pipe: Any) -> int:
        return int(pipe.vae.config.latent_channels)


FAMILIES: Final[Mapping[str, Family]] = {f.pipeline_class: f for f in (QwenImageFamily(), FluxFamily())}


def _scheduler_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "scheduler" / "scheduler_config.json"
    return read_config(path) if path.is_file() else {}


def read_config(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    return data


def family_for(model_dir: Path) -> tuple[Family, dict[str, Any]]:
    """The family of the pipeline in ``model_dir`` (by ``model_index.json``'s class) and that index."""
    index = read_config(model_dir / "model_index.json")
    name = str(index.get("_class_name", ""))
    family = FAMILIES.get(name)
    if family is None:
        known = ", ".join(FAMILIES)
        raise ValueError(f"{model_dir} holds a {name or 'unknown'} pipeline; the diffusers engine splits {known}")
    return family, index
