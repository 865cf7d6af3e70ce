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
(Qwen-Image and its fine-tunes), ``QwenImageEditPipeline`` (Qwen-Image-Edit: its encode stage also
encodes the input image, :class:`QwenImageEditFamily`; with a mask, ``QwenImageEditInpaintPipeline`` on the
same components) and ``FluxPipeline`` (FLUX.1 dev/schnell and
fine-tunes).

Facts the split must respect (see docs/reference/PIPELINE-NOTES.md): latents come back *packed* ``(B, tokens, C)``, so
decode needs the image size; a pipeline loaded without its VAE assumes ``vae_scale_factor = 8``, so the
factor is set from the VAE's config; Qwen-Image masks become ``None`` when all ones, and only the
denoise stage uses the seed.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import inspect
import json
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Final

import numpy as np
import torch

from omnimodel_runtime.engines.t2i.guidance import TEXT_LENGTHS

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
            min_steps=2 if _scheduler_config(model_dir).get("shift_terminal") else 1,
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


def _encode_kwargs(pipe: Any, max_sequence_length: int) -> dict[str, Any]:
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


def _to_uint8(pipe: Any, image: torch.Tensor) -> np.ndarray:
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

    def encode(
        self, pipe: Any, prompt: str, negative_prompt: str | None, max_sequence_length: int, image: Any = None
    ) -> Conditioning:
        kwargs = _encode_kwargs(pipe, max_sequence_length)
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

    def encode_together(
        self, pipe: Any, prompt: str, negative_prompt: str | None, max_sequence_length: int, image: Any = None
    ) -> Conditioning:
        """Both prompts as one batch of the pipeline's own encoding (``encode_prompt`` takes a list: it
        right-pads the template-wrapped prompts, encodes them under their padding mask and cuts each row at
        its length), each row then cut to its prompt's length, as :meth:`encode` returns it. The text
        encoder is launch-bound at prompt lengths: on the H200 (Qwen2.5-VL-7B) a prompt and the default
        negative took 53 ms together against 86 ms one after the other
        (bench/results/t2i-qwen-image-encode-together-h200.json)."""
        if negative_prompt is None:
            return self.encode(pipe, prompt, negative_prompt, max_sequence_length, image)
        kwargs = _encode_kwargs(pipe, max_sequence_length)
        embeds, mask = pipe.encode_prompt(prompt=[prompt, negative_prompt], **kwargs)
        # No mask: both rows have the same length (the pipeline drops an all-ones mask). Neither row gets a
        # mask either: a prompt encoded alone has none, and denoise must see the tensors encode gives.
        lengths = [int(embeds.shape[1])] * 2 if mask is None else [int(n) for n in mask.sum(dim=1).tolist()]
        tensors = {
            "prompt_embeds": embeds[:1, : lengths[0]].contiguous(),
            "negative_prompt_embeds": embeds[1:, : lengths[1]].contiguous(),
        }
        return Conditioning(tensors=tensors, prompt_tokens=lengths[0])

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

    def merge_guidance(
        self, positive: Mapping[str, Any], negative: tuple[Any, ...], *, text_lengths: bool = False
    ) -> dict[str, Any] | None:
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
            if text_lengths and mask is None and neg_mask is None:
                # Each row is its prompt then padding: fused blocks attend per row over its real tokens
                # (engines/t2i/fused.py) instead of through the mask.
                lengths = (int(embeds.shape[1]),) * embeds.shape[0] + (int(neg_embeds.shape[1]),) * embeds.shape[0]
                merged["attention_kwargs"] = {**(positive.get("attention_kwargs") or {}), TEXT_LENGTHS: lengths}
        merged["hidden_states"] = torch.cat([latents, latents])
        merged["timestep"] = torch.cat([positive["timestep"], positive["timestep"]])
        if positive.get("guidance") is not None:
            merged["guidance"] = torch.cat([positive["guidance"], positive["guidance"]])
        merged["img_shapes"] = img_shapes + img_shapes
        return merged

    def dummy_conditioning(self, pipe: Any, condition: tuple[int, int] | None = None) -> Conditioning:
        transformer = pipe.transformer
        embeds = torch.zeros(
            (1, 4, transformer.config.joint_attention_dim), dtype=transformer.dtype, device=transformer.device
        )
        return Conditioning(tensors={"prompt_embeds": embeds}, prompt_tokens=4)

    def latent_channels(self, pipe: Any) -> int:
        return int(pipe.vae.config.z_dim)


class QwenImageEditFamily(QwenImageFamily):
    """``QwenImageEditPipeline`` (Qwen-Image-Edit): Qwen-Image's transformer and VAE, and a Qwen2.5-VL text
    encoder that also sees the input image through its processor (the image's tokens stay in the prompt
    embeddings, after a 64-token template prefix). The input image is resized to about one megapixel at
    its aspect ratio (``calculate_dimensions``), VAE-encoded (the distribution's mode, so no seed), and its
    packed latents are appended to the noise along the sequence in every transformer call.

    The split: encode runs the processor, the text encoder and the VAE's encoder (what ``__call__`` does
    before it draws noise); denoise calls the pipeline with the embeddings and, as ``image``, a blank
    picture of the input's size (``__call__`` reads only its size, to work out the condition's), with
    ``_encode_vae_image`` answered by the latents encode sent; decode is Qwen-Image's. diffusers 0.42's
    ``__call__`` cannot take the latents as ``image`` itself: it reads ``image.size`` as a PIL size and
    then a prompt image that only a PIL input defines.
    """

    pipeline_class = "QwenImageEditPipeline"
    # cfg_batch: both guidance branches' calls are Qwen-Image's (the same keyword arguments, the noisy and
    # the input image's latents as one image stream), so Qwen-Image's merge_guidance batches them.
    batches_guidance: ClassVar[bool] = True
    edits: ClassVar[bool] = True
    inpaints: ClassVar[bool] = True
    encode_components: ClassVar[tuple[str, ...]] = (*ENCODE_COMPONENTS, "processor", "vae")
    # One prompt at a time under cfg_batch too (the base class's): each prompt's encoding carries the input
    # image's tokens through the processor.
    encode_together = Family.encode_together
    # ``calculate_dimensions``' target area in ``QwenImageEditPipeline.__call__``.
    CONDITION_AREA: ClassVar[int] = 1024 * 1024

    def load_overrides(self, model_dir: Path, keep: set[str]) -> dict[str, Any]:
        return {"processor": load_qwen_vl_processor(model_dir / "processor")} if "processor" in keep else {}

    def configure(self, pipe: Any, model_dir: Path) -> None:
        super().configure(pipe, model_dir)
        if getattr(pipe, "vae", None) is None:
            # Without its VAE the pipeline assumes 16 latent channels (Qwen-Image's z_dim).
            pipe.latent_channels = int(read_config(model_dir / "vae" / "config.json")["z_dim"])

    def defaults(self, pipe_class: type[Any], model_dir: Path) -> PipelineDefaults:
        return dataclasses.replace(super().defaults(pipe_class, model_dir), condition_size=self.condition_size)

    def condition_size(self, width: int, height: int) -> tuple[int, int]:
        """The size the pipeline encodes an input image of ``width`` x ``height`` at."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions  # noqa: PLC0415

        w, h, _ = calculate_dimensions(self.CONDITION_AREA, width / height)
        return int(w), int(h)

    def encode(
        self, pipe: Any, prompt: str, negative_prompt: str | None, max_sequence_length: int, image: Any = None
    ) -> Conditioning:
        if image is None:
            raise ValueError("QwenImageEditPipeline encodes a prompt with its input image")
        tensors, pixels, prompt_tokens = self._embed(pipe, prompt, negative_prompt, max_sequence_length, image)
        # The edit pipeline conditions on the latent distribution's mode: no seed.
        tensors[IMAGE_LATENTS] = pipe._encode_vae_image(pixels, generator=None)
        return Conditioning(tensors=tensors, prompt_tokens=prompt_tokens)

    def _embed(
        self, pipe: Any, prompt: str, negative_prompt: str | None, max_sequence_length: int, image: Any
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor, int]:
        """The prompt embeddings (with the image), the VAE's input pixels on the device, and the prompt's
        token count: what ``__call__`` computes from the input image before it draws noise."""
        width, height = self.condition_size(*image.size)
        # As __call__ does: the resized picture goes to the text encoder's processor, its preprocessed
        # pixels to the VAE, both at the condition's size.
        prompt_image = pipe.image_processor.resize(image, height, width)
        pixels = pipe.image_processor.preprocess(prompt_image, height, width).unsqueeze(2)
        device = pipe._execution_device
        kwargs = _encode_kwargs(pipe, max_sequence_length)
        tensors: dict[str, torch.Tensor] = {}
        embeds, mask = pipe.encode_prompt(prompt=prompt, image=prompt_image, **kwargs)
        tensors["prompt_embeds"] = embeds
        if mask is not None:
            tensors["prompt_embeds_mask"] = mask
        if negative_prompt is not None:
            neg, neg_mask = pipe.encode_prompt(prompt=negative_prompt, image=prompt_image, **kwargs)
            tensors["negative_prompt_embeds"] = neg
            if neg_mask is not None:
                tensors["negative_prompt_embeds_mask"] = neg_mask
        return tensors, pixels.to(device=device, dtype=embeds.dtype), int(embeds.shape[1])

    def inpaint_pipeline(self, pipe: Any, model_dir: Path) -> Any:
        from diffusers import QwenImageEditInpaintPipeline  # noqa: PLC0415
        from diffusers.image_processor import VaeImageProcessor  # noqa: PLC0415

        # The same module objects (no second copy of any weight), the components this stage skipped None.
        inpaint = QwenImageEditInpaintPipeline(**pipe.components)
        self.configure(inpaint, model_dir)
        if getattr(inpaint, "vae", None) is None:
            # Built in __init__ from the VAE-less defaults, like image_processor (configure): redo it.
            inpaint.mask_processor = VaeImageProcessor(
                vae_scale_factor=inpaint.vae_scale_factor * self.patch_size(),
                vae_latent_channels=inpaint.latent_channels,
                do_normalize=False,
                do_binarize=True,
                do_convert_grayscale=True,
            )
        inpaint.set_progress_bar_config(disable=True)
        return inpaint

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
        tensors, pixels, prompt_tokens = self._embed(inpaint, prompt, negative_prompt, max_sequence_length, image)
        # QwenImageEditInpaintPipeline.prepare_latents: the image latents are a *sample* of the VAE's
        # distribution, drawn from the first image's generator before any noise. Drawn here (the VAE is in
        # this stage) and the generators' states sent on, so denoise draws its noise where diffusers does.
        tensors[IMAGE_LATENTS] = inpaint._encode_vae_image(pixels, generator=list(generators))
        width, height = self.condition_size(*image.size)
        # diffusers' own mask preprocessing (grey, resized to the condition's size, binarised at 0.5).
        tensors[MASK_CONDITION] = inpaint.mask_processor.preprocess(mask, height=height, width=width)
        tensors[GENERATOR_STATES] = torch.stack([g.get_state() for g in generators])
        return Conditioning(tensors=tensors, prompt_tokens=prompt_tokens)

    def denoise_inputs(
        self,
        pipe: Any,
        items: Sequence[tuple[Conditioning, int]],
        source: tuple[int, int] | None,
        strength: float | None = None,
    ) -> tuple[dict[str, Any], contextlib.AbstractContextManager[Any]]:
        if source is None:
            raise ValueError("an edit needs the input image's size")
        from PIL import Image  # noqa: PLC0415

        device = pipe._execution_device
        latents = torch.cat([c.tensors[IMAGE_LATENTS].to(device).repeat_interleave(n, dim=0) for c, n in items])
        embeddings = [
            (Conditioning({k: v for k, v in c.tensors.items() if k not in _NOT_EMBEDDINGS}, c.prompt_tokens), n)
            for c, n in items
        ]
        kwargs: dict[str, Any] = {**self.batch(embeddings, device), "image": Image.new("RGB", source)}
        if strength is not None:
            # One mask row per image; the pipeline's mask processor passes a binarised tensor of its size on.
            masks = [c.tensors[MASK_CONDITION].to(device).repeat_interleave(n, dim=0) for c, n in items]
            kwargs |= {"mask_image": torch.cat(masks), "strength": strength}
        return kwargs, _encoded_image(pipe, latents)

    def dummy_conditioning(self, pipe: Any, condition: tuple[int, int] | None = None) -> Conditioning:
        width, height = condition or self.condition_size(1, 1)
        base = super().dummy_conditioning(pipe)
        factor, ref = pipe.vae_scale_factor, base.tensors["prompt_embeds"]
        shape = (1, int(pipe.latent_channels), 1, height // factor, width // factor)
        latents = torch.zeros(shape, dtype=ref.dtype, device=ref.device)
        return Conditioning(tensors={**base.tensors, IMAGE_LATENTS: latents}, prompt_tokens=base.prompt_tokens)


# The normalised VAE latents of an edit's input image, ``(1, z_dim, 1, h, w)``, from encode to denoise.
IMAGE_LATENTS: Final = "image_latents"
# A masked edit's mask as diffusers' mask processor makes it, ``(1, 1, H, W)`` at the condition's size,
# 1.0 where to repaint.
MASK_CONDITION: Final = "mask_condition"
# A masked edit's CPU generator states, ``(n, state bytes)`` uint8, after encode drew the VAE sample.
GENERATOR_STATES: Final = "generator_states"
_NOT_EMBEDDINGS: Final = frozenset({IMAGE_LATENTS, MASK_CONDITION, GENERATOR_STATES})


def restore_generators(states: torch.Tensor) -> list[torch.Generator]:
    """CPU generators in the states :data:`GENERATOR_STATES` carries (one row each)."""
    generators = []
    for row in states.to("cpu", torch.uint8):
        generator = torch.Generator("cpu")
        # A copy: set_state reads the tensor's whole storage, and a row of the stacked states shares it.
        generator.set_state(row.clone())
        generators.append(generator)
    return generators


@contextlib.contextmanager
def _encoded_image(pipe: Any, latents: torch.Tensor) -> Iterator[None]:
    """Answer the pipeline's ``_encode_vae_image`` with ``latents`` for one call (an instance attribute
    shadows the method; removed afterwards)."""

    def encoded(module: Any, image: Any, generator: Any = None) -> torch.Tensor:
        return latents

    pipe._encode_vae_image = types.MethodType(encoded, pipe)
    try:
        yield
    finally:
        pipe.__dict__.pop("_encode_vae_image", None)


def load_qwen_vl_processor(path: Path) -> Any:
    """The checkpoint's ``Qwen2VLProcessor``. transformers builds its video processor only with
    torchvision; without it the processor is built from its tokenizer and image processor (the same
    classes and code paths for text and images) and cannot take videos, which an edit never sends."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessor, Qwen2VLProcessor  # noqa: PLC0415

    try:
        return Qwen2VLProcessor.from_pretrained(path)
    except ImportError:
        pass

    class NoVideo(Qwen2VLProcessor):  # type: ignore[misc]  # transformers is untyped here
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument_name == "video_processor":
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    image = Qwen2VLImageProcessor.from_pretrained(path)
    geometry = types.SimpleNamespace(merge_size=image.merge_size, temporal_patch_size=image.temporal_patch_size)
    return NoVideo(image_processor=image, tokenizer=AutoTokenizer.from_pretrained(path), video_processor=geometry)


class FluxFamily(Family):
    """``FluxPipeline``: CLIP (pooled) + T5 (sequence, always padded to ``max_sequence_length``, so no
    mask), MMDiT transformer, 2-D VAE with scaling and shift factors."""

    pipeline_class = "FluxPipeline"

    def vae_scale_factor(self, vae_config: Mapping[str, Any]) -> int:
        return int(2 ** (len(vae_config["block_out_channels"]) - 1))

    def encode(
        self, pipe: Any, prompt: str, negative_prompt: str | None, max_sequence_length: int, image: Any = None
    ) -> Conditioning:
        kwargs = _encode_kwargs(pipe, max_sequence_length)
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

    def dummy_conditioning(self, pipe: Any, condition: tuple[int, int] | None = None) -> Conditioning:
        config, ref = pipe.transformer.config, pipe.transformer
        embeds = torch.zeros((1, 4, config.joint_attention_dim), dtype=ref.dtype, device=ref.device)
        pooled = torch.zeros((1, config.pooled_projection_dim), dtype=ref.dtype, device=ref.device)
        return Conditioning(tensors={"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}, prompt_tokens=4)

    def latent_channels(self, pipe: Any) -> int:
        return int(pipe.vae.config.latent_channels)


FAMILIES: Final[Mapping[str, Family]] = {
    f.pipeline_class: f for f in (QwenImageFamily(), QwenImageEditFamily(), FluxFamily())
}


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
