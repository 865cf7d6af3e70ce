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
unpacked and de-normalised; a :class:`Family` says exactly that. The families:
:mod:`~omnimodel_runtime.engines.t2i.qwen_image` (``QwenImagePipeline``, Qwen-Image and its fine-tunes;
``QwenImageEditPipeline``, Qwen-Image-Edit: its encode stage also encodes the input image; with a mask,
``QwenImageEditInpaintPipeline`` on the same components) and :mod:`~omnimodel_runtime.engines.t2i.flux`
(``FluxPipeline``, FLUX.1 dev/schnell and fine-tunes); :mod:`~omnimodel_runtime.engines.t2i.families`
finds the one a model directory holds.

Facts the split must respect (see docs/reference/PIPELINE-NOTES.md): latents come back *packed* ``(B, tokens, C)``, so
decode needs the image size; a pipeline loaded without its VAE assumes ``vae_scale_factor = 8``, so the
factor is set from the VAE's config; Qwen-Image masks become ``None`` when all ones, and only the
denoise stage uses the seed.
"""

from __future__ import annotations

import abc
import contextlib
import inspect
import json
from collections.abc import Callable, Mapping, Sequence
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
    # Edit pipelines: the size (width, height) the pipeline encodes an input image of a given size at.
    condition_size: Callable[[int, int], tuple[int, int]] | None = None


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
    # Whether the pipeline edits an input image (its encode stage then also encodes the image).
    edits: ClassVar[bool] = False
    # Prefixes of the components the encode stage loads.
    encode_components: ClassVar[tuple[str, ...]] = ENCODE_COMPONENTS
    # Whether masked edits are served (an inpainting pipeline on the same components).
    inpaints: ClassVar[bool] = False

    # ------------------------------------------------------------ loading

    def components(self, names: Sequence[str], role: str) -> set[str]:
        """Which of the pipeline's components a stage of ``role`` loads (the rest load as ``None``)."""
        prefixes = {
            "encode": self.encode_components,
            "denoise": DENOISE_COMPONENTS,
            "decode": DECODE_COMPONENTS,
        }.get(role)
        if prefixes is None:  # the whole pipeline in one stage
            return set(names)
        return {n for n in names if n.startswith(prefixes)}

    def load_overrides(self, model_dir: Path, keep: set[str]) -> dict[str, Any]:
        """Components to hand ``from_pretrained`` ready-made instead of letting it load them."""
        return {}

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
            min_steps=2 if scheduler_config(model_dir).get("shift_terminal") else 1,
        )

    def default_sample_size(self, transformer_config: Mapping[str, Any]) -> int:
        return 128

    # ------------------------------------------------------------ the three stages

    @abc.abstractmethod
    def encode(
        self, pipe: Any, prompt: str, negative_prompt: str | None, max_sequence_length: int, image: Any = None
    ) -> Conditioning:
        """Embed one prompt (and the negative one when guidance is on), one row each; an edit pipeline
        also encodes its input ``image`` (an RGB ``PIL.Image``)."""

    def encode_together(
        self, pipe: Any, prompt: str, negative_prompt: str | None, max_sequence_length: int, image: Any = None
    ) -> Conditioning:
        """:meth:`encode` with both guidance branches' prompts in one text-encoder pass, where the family
        can (``cfg_batch``): the same rows, rounded otherwise (batched products); elsewhere :meth:`encode`."""
        return self.encode(pipe, prompt, negative_prompt, max_sequence_length, image)

    def denoise_inputs(
        self,
        pipe: Any,
        items: Sequence[tuple[Conditioning, int]],
        source: tuple[int, int] | None,
        strength: float | None = None,
    ) -> tuple[dict[str, Any], contextlib.AbstractContextManager[Any]]:
        """The conditioning arguments of one ``pipe(...)`` call for several requests (:meth:`batch`) and
        a context to make that call in; ``strength`` is given for masked edits only (``pipe`` is then the
        :meth:`inpaint_pipeline`)."""
        if strength is not None:
            raise ValueError(f"{self.pipeline_class} serves no masked edits")
        return self.batch(items, pipe._execution_device), contextlib.nullcontext()

    def inpaint_pipeline(self, pipe: Any, model_dir: Path) -> Any:
        """The inpainting pipeline on ``pipe``'s components (masked edits; see :attr:`inpaints`)."""
        raise ValueError(f"{self.pipeline_class} serves no masked edits")

    def encode_masked(
        self,
        inpaint: Any,
        prompt: str,
        negative_prompt: str | None,
        max_sequence_length: int,
        image: Any,
        mask: Any,
        generators: Sequence[torch.Generator],
    ) -> Conditioning:
        """:meth:`encode` for a masked edit, on the :meth:`inpaint_pipeline`; ``mask`` is a ``PIL`` ``L``
        image, white where to repaint (diffusers' convention)."""
        raise ValueError(f"{self.pipeline_class} serves no masked edits")

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

    def merge_guidance(
        self, positive: Mapping[str, Any], negative: tuple[Any, ...], *, text_lengths: bool = False
    ) -> dict[str, Any] | None:
        """The transformer kwargs of one call on ``[positive; negative]`` rows (``cfg_batch``), from the
        pipeline's positive call and its ``encode_prompt`` result for the negative prompt; ``None`` where
        this family cannot merge them (the call then runs as the pipeline makes it). ``text_lengths``: the
        transformer's blocks take each row's real prompt length as an attention kwarg (``fuse_blocks``)."""
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
    def dummy_conditioning(self, pipe: Any, condition: tuple[int, int] | None = None) -> Conditioning:
        """Zero embeddings of the right shapes (warms up a denoise stage without a text encoder); for an
        edit, zero image latents of an input image encoded at ``condition`` pixels."""

    def dummy_latents(self, pipe: Any, height: int, width: int) -> torch.Tensor:
        """Zero packed latents for one image (warms up a decode stage without a transformer)."""
        factor, patch = pipe.vae_scale_factor, self.patch_size()
        tokens = (height // (factor * patch)) * (width // (factor * patch))
        channels = self.latent_channels(pipe) * patch * patch
        return torch.zeros((1, tokens, channels), dtype=pipe.vae.dtype, device=pipe.vae.device)

    @abc.abstractmethod
    def latent_channels(self, pipe: Any) -> int:
        """Channels of one unpacked latent cell."""


def encode_kwargs(pipe: Any, max_sequence_length: int) -> dict[str, Any]:
    """``encode_prompt``'s arguments for one request's rows (one image a prompt: batching repeats them)."""
    return {"device": pipe._execution_device, "num_images_per_prompt": 1, "max_sequence_length": max_sequence_length}


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


def to_uint8(pipe: Any, image: torch.Tensor) -> np.ndarray:
    """``postprocess``'s de-normalisation, then the float32 rounding diffusers' ``numpy_to_pil`` applies
    (a NaN, which some schedules produce at one step, becomes black instead of an undefined cast).

    The rounding runs where the image is, so the host copies uint8 (half the bytes of the bf16 image it
    copied before, a quarter of a float32 one) and does no float work (10–20 ms for a 1024² image on two
    CPU cores). It is the same IEEE float32 arithmetic and round-half-to-even as numpy's, and the pixels
    equal the host rounding's on CPU (NaNs included; the tests compare with diffusers' PIL output) and on
    an H100 (bench/t2i_speed.py's ``hostround`` variant: Qwen-Image at 512² and 1024², max difference 0)."""
    floats = pipe.image_processor.postprocess(image, output_type="pt").float()
    pixels = (torch.nan_to_num(floats, nan=0.0) * 255).round().to(torch.uint8)
    return pixels.permute(0, 2, 3, 1).cpu().numpy()


def scheduler_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "scheduler" / "scheduler_config.json"
    return read_config(path) if path.is_file() else {}


def read_config(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    return data
