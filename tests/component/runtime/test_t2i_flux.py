"""The diffusers engine is generic over pipelines with the same hooks: ``FluxPipeline`` (CLIP + T5 text
encoders, pooled embeddings, no masks, scaled/shifted 2-D VAE) split into encode → denoise → decode gives
diffusers' own pixels, as Qwen-Image does.

The tiny FLUX is built here with the real classes at diffusers' test sizes; its two tokenizers are
byte-level BPEs trained locally (nothing is downloaded).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from stage_engines import diffusers_images, diffusers_pipeline, images_of, stages_in_process
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from omnimodel_runtime.engines.t2i.diffusers import DiffusersImageEngine
from omnimodel_runtime.engines.t2i.flux import FluxFamily
from omnimodel_runtime.pipeline import ModelSource, get_preset
from omnimodel_runtime.protocol.images import TextToImageParams
from omnimodel_runtime.protocol.stage import StageParams, StageRequest

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="module")]

PROMPT = "a painting of a squirrel eating a burger"


def _tokenizer(max_length: int) -> Any:
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([PROMPT, "bad quality, blurry", "a red fox"] * 20, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", model_max_length=max_length
    )


@pytest.fixture(scope="module")
def tiny_flux(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    clip_tok, t5_tok = _tokenizer(77), _tokenizer(512)
    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=[4, 4, 8],
    )
    torch.manual_seed(0)
    clip = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(clip_tok),
            hidden_size=32,
            intermediate_size=37,
            num_attention_heads=4,
            num_hidden_layers=2,
            projection_dim=32,
            pad_token_id=clip_tok.pad_token_id,
            eos_token_id=clip_tok.eos_token_id,
            bos_token_id=clip_tok.pad_token_id,
        )
    )
    torch.manual_seed(0)
    t5 = T5EncoderModel(
        T5Config(
            vocab_size=len(t5_tok), d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4, decoder_start_token_id=0
        )
    )
    torch.manual_seed(0)
    vae = AutoencoderKL(
        sample_size=32,
        in_channels=3,
        out_channels=3,
        block_out_channels=(4,),
        layers_per_block=1,
        latent_channels=1,
        norm_num_groups=1,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0609,
        scaling_factor=1.5035,
    )
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        text_encoder=clip,
        text_encoder_2=t5,
        tokenizer=clip_tok,
        tokenizer_2=t5_tok,
        transformer=transformer,
        vae=vae,
    )
    out = tmp_path_factory.mktemp("tiny-flux")
    pipe.save_pretrained(out)
    return out


@pytest.mark.slow
async def test_a_split_flux_pipeline_gives_diffusers_pixels(tiny_flux: Path) -> None:
    pipeline = get_preset("text-to-image").pipeline(ModelSource(source=f"file://{tiny_flux}"))
    cfg = {"negative_prompt": "bad quality", "true_cfg_scale": 2.0}
    params = {"n": 2, "width": 16, "height": 24, "num_inference_steps": 3, "seed": 9, **cfg}
    request = StageRequest(
        request_id=f"r{time.monotonic_ns()}", prompt=PROMPT, params=StageParams(image=TextToImageParams(**params))
    )
    async with stages_in_process(pipeline, tiny_flux, engine_class=DiffusersImageEngine) as deployed:
        assert deployed.engines["encode"].components == ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")
        assert deployed.engines["denoise"].components == ("scheduler", "transformer")
        assert deployed.engines["decode"].components == ("vae",)
        served = await images_of(deployed, request)

    pipe = diffusers_pipeline("FluxPipeline", tiny_flux)
    expected = diffusers_images(pipe, PROMPT, seed=9, steps=3, n=2, width=16, height=24, **cfg)
    assert served.shape == (2, 24, 16, 3)
    assert len(np.unique(served)) > 20
    for got, want in zip(served, expected, strict=True):
        assert np.array_equal(got, want)


@pytest.mark.slow
async def test_flux_encodes_its_prompts_under_cfg_batch_as_without_it(tiny_flux: Path) -> None:
    """``cfg_batch``'s one-pass encoding is Qwen-Image's: FLUX (two encoders, pooled rows, no masks) encodes
    the prompt and the negative prompt as without it, one after the other."""
    pipe = diffusers_pipeline("FluxPipeline", tiny_flux)
    family = FluxFamily()
    with torch.inference_mode():
        alone = family.encode(pipe, PROMPT, "bad quality", 512).tensors
        together = family.encode_together(pipe, PROMPT, "bad quality", 512).tensors
    names = {"prompt_embeds", "pooled_prompt_embeds", "negative_prompt_embeds", "negative_pooled_prompt_embeds"}
    assert alone.keys() == together.keys() == names
    for name, tensor in alone.items():
        assert torch.equal(together[name], tensor)
