"""The Qwen-Image families: ``QwenImagePipeline`` (Qwen-Image and its fine-tunes) and ``QwenImageEditPipeline``
(Qwen-Image-Edit, whose encode stage also encodes the input image; with a mask,
``QwenImageEditInpaintPipeline`` on the same components), and the tensors an edit sends from encode to
denoise. :mod:`~omnimodel_runtime.engines.t2i.family` says how a family splits a pipeline."""

from __future__ import annotations

import contextlib
import dataclasses
import types
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Final

import numpy as np
import torch

from omnimodel_runtime.engines.t2i.family import (
    ENCODE_COMPONENTS,
    Conditioning,
    Family,
    PipelineDefaults,
    encode_kwargs,
    pad_and_mask,
    read_config,
    to_uint8,
)
from omnimodel_runtime.engines.t2i.guidance import TEXT_LENGTHS


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
        kwargs = encode_kwargs(pipe, max_sequence_length)
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
        kwargs = encode_kwargs(pipe, max_sequence_length)
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
        return to_uint8(pipe, image)

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
        kwargs = encode_kwargs(pipe, max_sequence_length)
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
