"""Masked image edits on the tiny Qwen-Image-Edit checkpoint: through our stages (split encode → denoise →
decode, and whole) they equal diffusers' own ``QwenImageEditInpaintPipeline(...)`` called on the same
image, mask, prompt, strength and seed; outside the mask the output is the input's VAE round trip; and
the official ``openai`` client's ``images.edit(image=..., mask=..., prompt=...)`` against ``omnimodel
serve --preset qwen-image-edit``'s app (in process) gets that image.

The mask is OpenAI's (a PNG whose fully transparent pixels are where to edit); diffusers is given its
own convention (white = repaint), built here independently of the runtime's conversion. The inpainting
pipeline always works at the condition's size (about one megapixel), so every call here decodes
864x1216 pixels: a few seconds each on two cores.
"""

from __future__ import annotations

import asyncio
import base64
import io
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import pytest_asyncio
import torch
from PIL import Image
from prometheus_client import CollectorRegistry
from runtime_procs import torch_threads
from stage_engines import assert_rounding_only

from omnimodel_runtime.engines.base import EngineContext, NullMetrics
from omnimodel_runtime.engines.registry import create_engine
from omnimodel_runtime.engines.t2i.qwen_image import load_qwen_vl_processor
from omnimodel_runtime.errors import StageError
from omnimodel_runtime.metrics import StageMetricsFamily
from omnimodel_runtime.pipeline import EngineName, Modality, ModelSource, Pipeline, Route, Stage, StageKind, get_preset
from omnimodel_runtime.protocol.images import IMAGES_TENSOR, ImageEditParams, TextToImageParams
from omnimodel_runtime.protocol.stage import MediaInput, StageParams, StageRequest, TensorFrame
from omnimodel_runtime.serve import build_serve_app, serve_pipeline
from omnimodel_runtime.serving.orchestrator import Orchestrator
from omnimodel_runtime.settings import RuntimeSettings
from omnimodel_runtime.stage.handle import StageHandle
from omnimodel_runtime.stage.local import LocalStage

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="module")]

STEPS = 2
SOURCE = (40, 56)
# The pipeline's size for a 40x56 input: its aspect ratio at about one megapixel, multiples of 32.
OUTPUT = (864, 1216)
PROMPT = "make the cat blue"


def png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def source_png(seed: int) -> bytes:
    """Random pixels (a flat image would hide a wrong crop or resize)."""
    return png(np.random.default_rng(seed).integers(0, 256, (SOURCE[1], SOURCE[0], 3), dtype=np.uint8))


def masks(*, edit: bool = True) -> tuple[bytes, Image.Image]:
    """OpenAI's mask (RGBA PNG: alpha 0 where to edit; elsewhere opaque, or half transparent, which OpenAI
    does not edit) and the diffusers mask meaning the same (``L``: 255 where to repaint, 0 elsewhere)."""
    width, height = SOURCE
    alpha = np.full((height, width), 255, dtype=np.uint8)
    alpha[40:, :] = 128  # partly transparent: kept
    if edit:
        alpha[10:30, 5:25] = 0
    rgba = np.dstack([np.random.default_rng(9).integers(0, 256, (height, width, 3), dtype=np.uint8), alpha])
    repaint = np.zeros((height, width), dtype=np.uint8)
    if edit:
        repaint[10:30, 5:25] = 255
    return png(rgba), Image.fromarray(repaint, mode="L")


@pytest.fixture(scope="module", autouse=True)
def few_threads() -> Iterator[None]:
    """Two intra-op threads at most: the box is shared, and tiny models gain nothing from more."""
    with torch_threads(min(2, os.cpu_count() or 1)):
        yield


class Batches(NullMetrics):
    """The sizes of the denoise calls the engines ran."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def observe_batch(self, size: int) -> None:
        self.sizes.append(size)


BATCHES = Batches()


async def deploy(pipeline: Pipeline, model_dir: Path) -> Orchestrator:
    family = StageMetricsFamily(CollectorRegistry())
    handles: dict[str, StageHandle] = {}
    for stage in pipeline.stages:
        context = EngineContext(
            stage=stage, model_dir=model_dir, settings=RuntimeSettings(device="cpu"), metrics=BATCHES
        )
        handles[stage.name] = LocalStage(stage, create_engine(context), family.for_stage(stage.name))
    await asyncio.gather(*(h.start() for h in handles.values()))
    return Orchestrator(pipeline, handles)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def split(tiny_edit: Path) -> AsyncIterator[Orchestrator]:
    orchestrator = await deploy(get_preset("qwen-image-edit").pipeline(ModelSource(source="tiny://x")), tiny_edit)
    yield orchestrator
    await asyncio.gather(*(h.stop() for h in orchestrator.handles.values()))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def whole(tiny_edit: Path) -> AsyncIterator[Orchestrator]:
    stage = Stage(
        name="edit", kind=StageKind.DIFFUSION, engine=EngineName.DIFFUSERS, task="image-edit", outputs=(Modality.IMAGE,)
    )
    pipeline = Pipeline(
        name="edit-whole",
        model=ModelSource(source="tiny://x"),
        stages=(stage,),
        modalities=(Modality.IMAGE,),
        routes=(Route.IMAGE_EDITS,),
    )
    orchestrator = await deploy(pipeline, tiny_edit)
    yield orchestrator
    await asyncio.gather(*(h.stop() for h in orchestrator.handles.values()))


@pytest.fixture(scope="module")
def inpaint_pipe(tiny_edit: Path) -> Any:
    from diffusers import QwenImageEditInpaintPipeline

    pipe = QwenImageEditInpaintPipeline.from_pretrained(
        tiny_edit, processor=load_qwen_vl_processor(tiny_edit / "processor")
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def direct(
    pipe: Any, image: bytes, mask: Image.Image, *, seed: int, strength: float, n: int = 1, **kw: Any
) -> np.ndarray:
    """diffusers itself: one call on the decoded PIL image and mask, per-image generators seed + i."""
    images = pipe(
        image=Image.open(io.BytesIO(image)).convert("RGB"),
        mask_image=mask,
        prompt=PROMPT,
        strength=strength,
        num_images_per_prompt=n,
        num_inference_steps=STEPS,
        generator=[torch.Generator().manual_seed(seed + i) for i in range(n)],
        **kw,
    ).images
    return np.stack([np.asarray(i) for i in images])


async def masked_edit(
    orchestrator: Orchestrator, image: bytes, mask: bytes, *, strength: float = 1.0, **params: Any
) -> np.ndarray:
    request = StageRequest(
        request_id=f"r{time.monotonic_ns()}",
        prompt=PROMPT,
        media=(
            MediaInput(kind="image", tensor="image", format="image/png", param="image"),
            MediaInput(kind="image", tensor="mask", format="image/png", param="mask"),
        ),
        params=StageParams(
            image=TextToImageParams(num_inference_steps=STEPS, **params),
            edit=ImageEditParams(source_width=SOURCE[0], source_height=SOURCE[1], mask=True, strength=strength),
        ),
    )
    tensors = {"image": np.frombuffer(image, dtype=np.uint8), "mask": np.frombuffer(mask, dtype=np.uint8)}
    (batch,) = [
        np.asarray(frame.tensors[IMAGES_TENSOR])
        async for _, frame in orchestrator.generate_chain(request, [Modality.IMAGE], tensors=tensors)
        if isinstance(frame, TensorFrame)
    ]
    return batch


@pytest.mark.slow
async def test_split_and_whole_give_the_inpaint_pipelines_pixels(
    split: Orchestrator, whole: Orchestrator, inpaint_pipe: Any
) -> None:
    image, (mask, repaint) = source_png(1), masks()
    expected = direct(inpaint_pipe, image, repaint, seed=11, strength=0.7)
    assert expected.shape == (1, OUTPUT[1], OUTPUT[0], 3)
    assert len(np.unique(expected)) > 50
    assert np.array_equal(await masked_edit(split, image, mask, strength=0.7, seed=11), expected)
    assert np.array_equal(await masked_edit(whole, image, mask, strength=0.7, seed=11), expected)


@pytest.mark.slow
async def test_n_images_with_guidance_at_full_strength_are_the_inpaint_pipelines(
    split: Orchestrator, inpaint_pipe: Any
) -> None:
    """n = 2 (the VAE sample comes from the first image's generator, before its noise) with real
    classifier-free guidance, at strength 1.0, what a client that sends none gets."""
    image, (mask, repaint) = source_png(2), masks()
    guidance = {"negative_prompt": "blurry", "true_cfg_scale": 3.0}
    expected = direct(inpaint_pipe, image, repaint, seed=12, strength=1.0, n=2, **guidance)
    got = await masked_edit(split, image, mask, seed=12, n=2, **guidance)
    assert np.array_equal(got, expected)
    assert not np.array_equal(got[0], got[1])


@pytest.mark.slow
async def test_masked_edits_batched_together_are_each_the_inpaint_pipelines(
    whole: Orchestrator, inpaint_pipe: Any
) -> None:
    """Two masked edits at one strength share a denoise call (their masks, latents and generators side
    by side); each is still the image diffusers makes of it alone, to batching's rounding. On the whole
    pipeline: its worker encodes every queued request before it picks a batch (split, the second
    request's encode outlasts denoise's batch wait)."""
    image, (mask, repaint) = source_png(5), masks()
    other = np.asarray(repaint).copy()
    other[:, :20] = 255 - other[:, :20]
    alpha = np.where(other == 255, 0, 255).astype(np.uint8)
    other_mask = png(np.dstack([np.zeros((*alpha.shape, 3), dtype=np.uint8), alpha]))
    BATCHES.sizes.clear()
    first, second = await asyncio.gather(
        masked_edit(whole, image, mask, strength=0.6, seed=21),
        masked_edit(whole, image, other_mask, strength=0.6, seed=22),
    )
    assert BATCHES.sizes == [2]
    alone = [
        direct(inpaint_pipe, image, repaint, seed=21, strength=0.6),
        direct(inpaint_pipe, image, Image.fromarray(other, mode="L"), seed=22, strength=0.6),
    ]
    for one, batched in zip(alone, (first, second), strict=True):
        # As for text to image: batched GEMMs round in another order, so a pixel may land one level off;
        # anything more would be the other request's mask, latents or noise.
        assert_rounding_only(one, batched)


@pytest.mark.slow
async def test_outside_the_mask_the_output_is_the_inputs_vae_round_trip(split: Orchestrator, inpaint_pipe: Any) -> None:
    """diffusers blends every step's latents with the input's (noised to the next step; at the last step
    unnoised), so outside the mask the final latents are the input image's VAE latents exactly: a mask
    with nothing transparent gives the VAE round trip of the input bit for bit. With a mask, the pixels
    outside it stay within a few levels of that round trip (the decoder's mid-block attention spreads a
    little of the edit), inside they change."""
    image = source_png(3)
    opaque, _ = masks(edit=False)
    kept = await masked_edit(split, image, opaque, seed=5)
    pipe = inpaint_pipe
    width, height = OUTPUT
    picture = pipe.image_processor.resize(Image.open(io.BytesIO(image)).convert("RGB"), height, width)
    pixels = pipe.image_processor.preprocess(picture, height, width).unsqueeze(2)
    with torch.inference_mode():
        # The input's VAE latents as the pipeline samples them (seed 5's generator), decoded unchanged.
        latents = pipe._encode_vae_image(pixels, generator=torch.Generator().manual_seed(5))
        z = pipe.vae.config.z_dim
        mean = torch.tensor(pipe.vae.config.latents_mean).view(1, z, 1, 1, 1)
        std = torch.tensor(pipe.vae.config.latents_std).view(1, z, 1, 1, 1)
        round_trip = pipe.vae.decode(latents * std + mean, return_dict=False)[0][:, :, 0]
    expected = (pipe.image_processor.postprocess(round_trip, output_type="np") * 255).round().astype(np.uint8)
    assert np.array_equal(kept, expected)

    mask, repaint = masks()
    edited = (await masked_edit(split, image, mask, seed=5))[0].astype(float)
    inside = np.asarray(repaint.resize(OUTPUT, Image.Resampling.NEAREST)) == 255
    diff = np.abs(edited - kept[0].astype(float)).mean(axis=2)
    assert diff[~inside].mean() < 3
    assert diff[inside].mean() > 5 * diff[~inside].mean()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def http(model_cache: Path) -> AsyncIterator[httpx.AsyncClient]:
    settings = RuntimeSettings(model_cache=model_cache, device="cpu")
    app = build_serve_app(settings, serve_pipeline("qwen-image-edit", "tiny://qwen-image-edit", device="cpu"))
    async with app.router.lifespan_context(app):
        await app.state.startup.wait()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=300) as client:
            yield client


@pytest.mark.slow
async def test_the_openai_clients_masked_edit_gets_the_inpaint_pipelines_image(
    http: httpx.AsyncClient, inpaint_pipe: Any
) -> None:
    image, (mask, repaint) = source_png(4), masks()
    sdk = openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="unused", http_client=http, max_retries=0)
    result = await sdk.images.edit(
        image=("in.png", image, "image/png"),
        mask=("mask.png", mask, "image/png"),
        prompt=PROMPT,
        extra_body={"num_inference_steps": STEPS, "seed": 7, "strength": 0.8},
    )
    assert result.data is not None and result.data[0].b64_json is not None
    assert result.size == f"{OUTPUT[0]}x{OUTPUT[1]}"
    got = np.asarray(Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json))))
    assert np.array_equal(got, direct(inpaint_pipe, image, repaint, seed=7, strength=0.8)[0])

    # The server checks what the gateway cannot see from the header: a size other than the pipeline's.
    with pytest.raises(openai.BadRequestError) as err:
        await sdk.images.edit(
            image=("in.png", image, "image/png"), mask=("mask.png", mask, "image/png"), prompt=PROMPT, size="64x64"
        )
    assert isinstance(err.value.body, dict) and err.value.body["param"] == "size"


def _resolve_masked(strength: float, **image: Any) -> Any:
    from omnimodel_runtime.engines.t2i.family import PipelineDefaults
    from omnimodel_runtime.engines.t2i.qwen_image import QwenImageEditFamily
    from omnimodel_runtime.engines.t2i.requests import resolve

    family = QwenImageEditFamily()
    defaults = PipelineDefaults(
        width=1024,
        height=1024,
        multiple=16,
        steps=50,
        true_cfg_scale=4.0,
        guidance_scale=None,
        guidance_distilled=False,
        max_sequence_length=512,
        condition_size=family.condition_size,
    )
    request = StageRequest(
        request_id="r",
        prompt=PROMPT,
        params=StageParams(
            image=TextToImageParams(num_inference_steps=STEPS, **image),
            edit=ImageEditParams(source_width=SOURCE[0], source_height=SOURCE[1], mask=True, strength=strength),
        ),
    )
    return resolve(request, defaults)


async def test_a_masked_edit_resolves_to_the_pipelines_size_and_a_strength_that_runs_a_step() -> None:
    resolved = _resolve_masked(0.01)  # 2 steps x 0.01: the pipeline still runs the last step
    assert (resolved.width, resolved.height, resolved.masked, resolved.strength) == (*OUTPUT, True, 0.01)
    assert _resolve_masked(0.5).key != _resolve_masked(0.6).key  # one strength per denoise call
    for strength, image, param in [(1e-17, {}, "strength"), (1.0, {"width": 64, "height": 64}, "size")]:
        with pytest.raises(StageError) as err:
            _resolve_masked(strength, **image)
        assert (err.value.status, err.value.param) == (400, param)
