"""The diffusers engine on the tiny Qwen-Image-Edit pipeline, in process: split (encode → denoise → decode)
equals whole equals diffusers' own ``QwenImageEditPipeline(...)`` on the same checkpoint and seed, the
seed and the input image decide the result, and what each stage loads.

Slow-ish on CPU whatever the output size: the pipeline always VAE-encodes the input image at about one
megapixel (tiny/image_edit.py), ~3 s on two cores.
"""

from __future__ import annotations

import io
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
import torch
from PIL import Image
from runtime_procs import random_png, torch_threads
from stage_engines import (
    Deployed,
    assert_rounding_only,
    conv3d_calls,
    diffusers_images,
    diffusers_pipeline,
    images_of,
    stages_in_process,
)

from omnimodel_runtime.engines.t2i.diffusers import DiffusersImageEngine
from omnimodel_runtime.engines.t2i.fused import MODULATIONS
from omnimodel_runtime.engines.t2i.qwen_image import QwenImageEditFamily, load_qwen_vl_processor
from omnimodel_runtime.errors import StageError
from omnimodel_runtime.pipeline import EngineName, Modality, ModelSource, Pipeline, Route, Stage, StageKind, get_preset
from omnimodel_runtime.protocol.images import ImageEditParams, TextToImageParams
from omnimodel_runtime.protocol.stage import MediaInput, StageParams, StageRequest

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="module")]

STEPS = 2


@pytest.fixture(scope="module", autouse=True)
def two_threads() -> Iterator[None]:
    with torch_threads(min(2, os.cpu_count() or 1)):
        yield


def whole_pipeline() -> Pipeline:
    stage = Stage(
        name="edit", kind=StageKind.DIFFUSION, engine=EngineName.DIFFUSERS, task="image-edit", outputs=(Modality.IMAGE,)
    )
    return Pipeline(
        name="edit-whole",
        model=ModelSource(source="tiny://x"),
        stages=(stage,),
        modalities=(Modality.IMAGE,),
        routes=(Route.IMAGE_EDITS,),
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def split(tiny_edit: Path) -> AsyncIterator[Deployed]:
    preset = get_preset("qwen-image-edit").pipeline(ModelSource(source="tiny://x"))
    async with stages_in_process(preset, tiny_edit, engine_class=DiffusersImageEngine) as deployed:
        yield deployed


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def whole(tiny_edit: Path) -> AsyncIterator[Deployed]:
    async with stages_in_process(whole_pipeline(), tiny_edit, engine_class=DiffusersImageEngine) as deployed:
        yield deployed


@pytest.fixture(scope="module")
def diffusers_pipe(tiny_edit: Path) -> Any:
    processor = load_qwen_vl_processor(tiny_edit / "processor")
    return diffusers_pipeline("QwenImageEditPipeline", tiny_edit, processor=processor)


def direct(pipe: Any, image: bytes, prompt: str, *, seed: int, n: int = 1, **kw: Any) -> np.ndarray:
    """diffusers itself, on the decoded PIL image."""
    picture = Image.open(io.BytesIO(image)).convert("RGB")
    return diffusers_images(pipe, prompt, seed=seed, steps=STEPS, n=n, image=picture, **kw)


async def edit(
    deployed: Deployed, image: bytes, prompt: str, source: tuple[int, int] | None = None, **params: Any
) -> np.ndarray:
    width, height = source or Image.open(io.BytesIO(image)).size
    request = StageRequest(
        request_id=f"r{time.monotonic_ns()}",
        prompt=prompt,
        media=(MediaInput(kind="image", tensor="image", format="image/png", param="image"),),
        params=StageParams(
            image=TextToImageParams(**{"num_inference_steps": STEPS, **params}),
            edit=ImageEditParams(source_width=width, source_height=height),
        ),
    )
    return await images_of(deployed, request, image=np.frombuffer(image, dtype=np.uint8))


@pytest.mark.slow
@pytest.mark.parametrize(
    "params",
    [
        {"seed": 11, "width": 32, "height": 32},
        {"seed": 12, "n": 2, "width": 48, "height": 32, "negative_prompt": "blurry", "true_cfg_scale": 3.0},
    ],
    ids=["plain-32", "n2-cfg-48x32"],
)
async def test_split_and_whole_give_the_diffusers_pipelines_pixels(
    split: Deployed, whole: Deployed, diffusers_pipe: Any, params: dict[str, Any]
) -> None:
    image, prompt = random_png(40, 56, seed=1), "make the cat blue"
    n = params.get("n", 1)
    extra = {k: params[k] for k in ("negative_prompt", "true_cfg_scale", "width", "height") if k in params}
    expected = direct(diffusers_pipe, image, prompt, seed=params["seed"], n=n, **extra)
    assert expected.shape == (n, params["height"], params["width"], 3)
    assert len(np.unique(expected)) > 50
    assert np.array_equal(await edit(split, image, prompt, **params), expected)
    assert np.array_equal(await edit(whole, image, prompt, **params), expected)


@pytest.mark.slow
async def test_its_prompts_encode_one_at_a_time_under_cfg_batch_too(diffusers_pipe: Any) -> None:
    # cfg_batch's one-pass encoding is Qwen-Image's: here each prompt's encoding carries the image's tokens,
    # so the edit family encodes as without it (the inherited Qwen-Image one would drop the image).
    picture = Image.open(io.BytesIO(random_png(40, 56, seed=1))).convert("RGB")
    family = QwenImageEditFamily()
    with torch.inference_mode():
        alone = family.encode(diffusers_pipe, "make the cat blue", "blurry", 512, picture).tensors
        together = family.encode_together(diffusers_pipe, "make the cat blue", "blurry", 512, picture).tensors
    assert alone.keys() == together.keys()
    assert "negative_prompt_embeds" in alone
    for name, tensor in alone.items():
        assert torch.equal(together[name], tensor)


@pytest.mark.slow
async def test_fused_blocks_give_the_diffusers_pipelines_pixels(tiny_edit: Path, diffusers_pipe: Any) -> None:
    # fuse_blocks on the edit family: its image stream is [noisy latents;
    # input image latents], the rotary table covers both parts, and the modulation rows of both guidance
    # branches come from the request's own schedule. The fused blocks round in another order: one level.
    image, prompt = random_png(40, 56, seed=1), "make the cat blue"
    params = {"seed": 13, "width": 48, "height": 32, "negative_prompt": "blurry", "true_cfg_scale": 3.0}
    preset = get_preset("qwen-image-edit").pipeline(ModelSource(source="tiny://x"))
    async with stages_in_process(preset, tiny_edit, engine_class=DiffusersImageEngine, fuse_blocks=True) as fused:
        modulations = getattr(fused.engines["denoise"]._pipe.transformer, MODULATIONS)
        built, (computed, looked_up) = modulations.tables_built, modulations.calls  # after the warm-up's
        got = await edit(fused, image, prompt, **params)
        assert modulations.tables_built == built + 1
        assert modulations.calls == [computed, looked_up + 2 * STEPS]  # two guidance branches a step
    expected = direct(
        diffusers_pipe, image, prompt, seed=13, width=48, height=32, negative_prompt="blurry", true_cfg_scale=3.0
    )
    assert_rounding_only(expected, got)


@pytest.mark.slow
async def test_vae_2d_encodes_the_input_and_decodes_the_result_without_3d_convolutions(
    tiny_edit: Path, diffusers_pipe: Any
) -> None:
    # Both VAE stages of an edit under vae_2d: the encode stage's VAE encodes the input image and the decode
    # stage's decodes the result, each convolution as its last time tap's 2D one. Neither runs a 3D
    # convolution (the text encoder's vision tower still embeds the image's patches with its own Conv3d),
    # and the pixels are diffusers' (the skipped taps met only zero frames: rounding).
    image, prompt = random_png(40, 56, seed=1), "make the cat blue"
    preset = get_preset("qwen-image-edit").pipeline(ModelSource(source="tiny://x"))
    async with stages_in_process(preset, tiny_edit, engine_class=DiffusersImageEngine, vae_2d=True) as deployed:
        assert {name for name, engine in deployed.engines.items() if "vae" in engine.components} == {"encode", "decode"}
        with conv3d_calls() as calls:
            got = await edit(deployed, image, prompt, seed=14, width=48, height=32)
    assert [call for call in calls if call.startswith("QwenImageCausalConv3d")] == []
    assert calls, "the vision tower's patch embedding ran no Conv3d: the count is not counting"
    expected = direct(diffusers_pipe, image, prompt, seed=14, width=48, height=32)
    assert_rounding_only(expected, got)


@pytest.mark.slow
@pytest.mark.parametrize("fuse_blocks", [False, True], ids=["cfg-batch", "cfg-batch-fused"])
async def test_cfg_batch_runs_both_guidance_branches_as_one_transformer_call_per_step(
    tiny_edit: Path, diffusers_pipe: Any, fuse_blocks: bool
) -> None:
    # Each step's two calls on [noisy latents; input image latents] as one call on [positive; negative]
    # rows: the negative prompt right-padded (masked, or with fuse_blocks attended over its own length).
    # Batched products and the padded attention round in another order: one level at most.
    image, prompt = random_png(40, 56, seed=1), "make the cat blue, keep the background"
    params = {"seed": 14, "n": 2, "width": 48, "height": 32, "negative_prompt": "blurry", "true_cfg_scale": 3.0}
    preset = get_preset("qwen-image-edit").pipeline(ModelSource(source="tiny://x"))
    engine_args = {"cfg_batch": True} | ({"fuse_blocks": True} if fuse_blocks else {})
    async with stages_in_process(preset, tiny_edit, engine_class=DiffusersImageEngine, **engine_args) as batched:
        sizes: list[int] = []
        block = batched.engines["denoise"]._pipe.transformer.transformer_blocks[0]
        handle = block.register_forward_pre_hook(
            lambda _m, _a, kwargs: sizes.append(kwargs["hidden_states"].shape[0]), with_kwargs=True
        )
        try:
            got = await edit(batched, image, prompt, **params)
        finally:
            handle.remove()
    assert sizes == [4] * STEPS  # [positive; negative] of both images, once a step
    extra = {k: params[k] for k in ("negative_prompt", "true_cfg_scale", "width", "height")}
    expected = direct(diffusers_pipe, image, prompt, seed=14, n=2, **extra)
    assert_rounding_only(expected, got)


@pytest.mark.slow
async def test_without_a_size_the_output_has_the_pipelines_size_for_the_input(
    split: Deployed, diffusers_pipe: Any
) -> None:
    """No size: the pipeline's own (the input's aspect ratio at about one megapixel, here 864x1216)."""
    image = random_png(28, 20, seed=2)
    expected = direct(diffusers_pipe, image, "a red cat", seed=3)
    assert expected.shape == (1, 864, 1216, 3)
    assert np.array_equal(await edit(split, image, "a red cat", seed=3), expected)


@pytest.mark.slow
async def test_the_seed_and_the_input_image_decide_the_result(split: Deployed) -> None:
    image = random_png(32, 32, seed=4)
    a = await edit(split, image, "a red cat", seed=5, width=32, height=32)
    assert np.array_equal(a, await edit(split, image, "a red cat", seed=5, width=32, height=32))
    assert not np.array_equal(a, await edit(split, image, "a red cat", seed=6, width=32, height=32))
    assert not np.array_equal(
        a, await edit(split, random_png(32, 32, seed=5), "a red cat", seed=5, width=32, height=32)
    )


@pytest.mark.slow
async def test_each_stage_loads_only_its_components(split: Deployed, whole: Deployed) -> None:
    loaded = {name: engine.components for name, engine in split.engines.items()}
    assert loaded == {
        "encode": ("processor", "text_encoder", "tokenizer", "vae"),
        "denoise": ("scheduler", "transformer"),
        "decode": ("vae",),
    }
    assert whole.engines["edit"].components == (
        "processor",
        "scheduler",
        "text_encoder",
        "tokenizer",
        "transformer",
        "vae",
    )


@pytest.mark.slow
async def test_an_undecodable_image_or_a_wrong_declared_size_is_a_400_naming_the_image(split: Deployed) -> None:
    with pytest.raises(StageError) as err:
        await edit(split, b"\x89PNG\r\n\x1a\nnot really", "a cat", source=(32, 32), seed=1, width=32, height=32)
    assert (err.value.status, err.value.param) == (400, "image")
    with pytest.raises(StageError) as err:
        await edit(split, random_png(32, 32, seed=1), "a cat", source=(64, 32), seed=1, width=32, height=32)
    assert (err.value.status, err.value.param) == (400, "image")
    assert "32x32" in err.value.message
