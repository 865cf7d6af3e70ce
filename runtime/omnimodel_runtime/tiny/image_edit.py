"""The tiny model of the ``qwen-image-edit`` preset: a random-weight diffusers ``QwenImageEditPipeline``.

The components of Qwen-Image-Edit: the Qwen2.5-VL text encoder, which also sees the input image (its
vision tower encodes the image; the image's tokens stay in the prompt embeddings), its ``Qwen2VLProcessor``
(tokenizer + Qwen2-VL image processor) in ``processor/``, ``QwenImageTransformer2DModel`` (the input
image's latents are appended to the noise along the sequence), ``AutoencoderKLQwenImage`` (encodes the
input image, decodes the result) and ``FlowMatchEulerDiscreteScheduler``. Built from the text-to-image
builder's parts with two differences:

- the tokenizer is trained on the edit template, whose system turn (64 tokens in Qwen's tokenizer, which
  ``QwenImageEditPipeline`` drops) must split into exactly 64 tokens here too;
- the VAE downsamples 8× (as Qwen-Image's does) at a quarter of the text-to-image tiny VAE's width: the
  pipeline always encodes the input image at about one megapixel (``calculate_dimensions(1024 * 1024,
  ratio)``, whatever the output size), which a 4× VAE with a wider first layer takes ~25 s to do on two CPU
  cores, this one ~3 s. The image processor keeps the vision tower's input at ≤ 112² pixels.

The processor is written as files (``preprocessor_config.json`` and the tokenizer's), not with
``save_pretrained``: transformers builds a ``Qwen2VLProcessor`` only with its video processor, which needs
torchvision (:func:`~omnimodel_runtime.engines.t2i.qwen_image.load_qwen_vl_processor` loads it either way).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Final

from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline
from diffusers.utils import logging as diffusers_logging
from transformers import Qwen2VLImageProcessor
from transformers.utils import logging as hf_logging

from omnimodel_runtime.tiny.text_to_image import SCHEDULER, SIZES, build_modules, build_tokenizer

# QwenImageEditPipeline.prompt_template_encode and prompt_template_encode_start_idx (diffusers 0.42).
TEMPLATE: Final = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a "
    "new image that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
TEMPLATE_PREFIX_TOKENS: Final = 64

EDIT_SIZES: Final[dict[str, dict[str, Any]]] = {
    "tiny": {
        **SIZES["tiny"],
        "vae": {
            **SIZES["tiny"]["vae"],
            "base_dim": 8,
            "dim_mult": [1, 2, 4, 4],
            "temperal_downsample": [False, True, True],
        },
        # Qwen2-VL geometry (14-pixel patches, 2x2 merge); few patches for the tiny vision tower.
        "image_processor": {"min_pixels": 56 * 56, "max_pixels": 112 * 112},
    },
}


def build(out: Path, *, seed: int, size: str = "tiny", device: str = "cpu") -> None:
    """Write a random-weight ``QwenImageEditPipeline`` (``size`` from :data:`EDIT_SIZES`) into ``out``."""
    if size not in EDIT_SIZES:
        raise ValueError(f"unknown size {size!r} for preset qwen-image-edit (known: {', '.join(EDIT_SIZES)})")
    arch = EDIT_SIZES[size]
    hf_logging.disable_progress_bar()
    diffusers_logging.disable_progress_bar()
    tokenizer = build_tokenizer(
        seed, template=TEMPLATE, prefix_tokens=TEMPLATE_PREFIX_TOKENS, pipeline="QwenImageEditPipeline"
    )
    text_encoder, transformer, vae = build_modules(arch, tokenizer, seed=seed, device=device)
    scheduler = FlowMatchEulerDiscreteScheduler(**SCHEDULER)
    # QwenImagePipeline has the same components but the processor: save through it, then add the
    # processor and name the edit pipeline in the index.
    QwenImagePipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer
    ).save_pretrained(out)
    processor_dir = out / "processor"
    tokenizer.save_pretrained(processor_dir)
    image_processor = Qwen2VLImageProcessor(**arch["image_processor"]).to_dict()
    image_processor |= {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor"}
    (processor_dir / "preprocessor_config.json").write_text(json.dumps(image_processor, indent=2, sort_keys=True))
    index_path = out / "model_index.json"
    index = json.loads(index_path.read_text())
    index["_class_name"] = "QwenImageEditPipeline"
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    (out / "README.md").write_text(
        f"Random-weight QwenImageEditPipeline ({size}) built by `omnimodel make-tiny --preset qwen-image-edit` "
        f"(seed {seed}). Not a trained model: its images are noise.\n"
    )
    (out / "omnimodel-build.json").write_text(
        json.dumps({"preset": "qwen-image-edit", "seed": seed, "size": size}) + "\n"
    )
