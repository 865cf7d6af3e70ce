"""The diffusers engine on the tiny Qwen-Image-Edit pipeline, in process: split (encode → denoise → decode)
equals whole equals diffusers' own ``QwenImageEditPipeline(...)`` on the same checkpoint and seed, the
seed and the input image decide the result, and what each stage loads.

Slow-ish on CPU whatever the output size: the pipeline always VAE-encodes the input image at about one
megapixel (tiny/image_edit.py), ~3 s on two cores.
"""

from __future__ import annotations

import asyncio
import io
import os
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
import torch
from PIL import Image
from prometheus_client import CollectorRegistry

from omnimodel_runtime.engines.base import EngineContext, NullMetrics
from omnimodel_runtime.engines.registry import create_engine
from omnimodel_runtime.engines.t2i.diffusers import DiffusersImageEngine
from omnimodel_runtime.engines.t2i.families import load_qwen_vl_processor
from omnimodel_runtime.errors import StageError
from omnimodel_runtime.metrics import StageMetricsFamily
from omnimodel_runtime.pipeline import EngineName, Modality, ModelSource, Pipeline, Route, Stage, StageKind, get_preset
from omnimodel_runtime.protocol.images import IMAGES_TENSOR, ImageEditParams, TextToImageParams
from omnimodel_runtime.protocol.stage import MediaInput, StageParams, StageRequest, TensorFrame
from omnimodel_runtime.serving.orchestrator import Orchestrator
from omnimodel_runtime.settings import RuntimeSettings
from omnimodel_runtime.stage.handle import StageHandle
from omnimodel_runtime.stage.local import LocalStage

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

STEPS = 2


def png(width: int, height: int, seed: int) -> bytes:
    """A PNG of random pixels (a flat image would hide a wrong crop or resize)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def tiny_edit(model_cache: Path) -> Path:
    from omnimodel_runtime.tiny import ensure_tiny

    return ensure_tiny("qwen-image-edit", model_cache)


@pytest.fixture(scope="module", autouse=True)
def torch_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    yield
    torch.set_num_threads(before)


@dataclass
class Deployed:
    orchestrator: Orchestrator
    engines: dict[str, DiffusersImageEngine]


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


async def deploy(pipeline: Pipeline, model_dir: Path) -> Deployed:
    family = StageMetricsFamily(CollectorRegistry())
    handles: dict[str, StageHandle] = {}
    engines: dict[str, DiffusersImageEngine] = {}
    for stage in pipeline.stages:
        context = EngineContext(
            stage=stage, model_dir=model_dir, settings=RuntimeSettings(device="cpu"), metrics=NullMetrics()
        )
        engine = create_engine(context)
        assert isinstance(engine, DiffusersImageEngine)
        engines[stage.name] = engine
        handles[stage.name] = LocalStage(stage, engine, family.for_stage(stage.name))
    await asyncio.gather(*(h.start() for h in handles.values()))
    return Deployed(Orchestrator(pipeline, handles), engines)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def split(tiny_edit: Path) -> AsyncIterator[Deployed]:
    deployed = await deploy(get_preset("qwen-image-edit").pipeline(ModelSource(source="tiny://x")), tiny_edit)
    yield deployed
    await asyncio.gather(*(h.stop() for h in deployed.orchestrator.handles.values()))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def whole(tiny_edit: Path) -> AsyncIterator[Deployed]:
    deployed = await deploy(whole_pipeline(), tiny_edit)
    yield deployed
    await asyncio.gather(*(h.stop() for h in deployed.orchestrator.handles.values()))


@pytest.fixture(scope="module")
def diffusers_pipe(tiny_edit: Path) -> Any:
    from diffusers import QwenImageEditPipeline

    pipe = QwenImageEditPipeline.from_pretrained(tiny_edit, processor=load_qwen_vl_processor(tiny_edit / "processor"))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def direct(pipe: Any, image: bytes, prompt: str, *, seed: int, n: int = 1, **kw: Any) -> np.ndarray:
    """diffusers itself: one call on the decoded PIL image, per-image generators seeded seed + i."""
    generators = [torch.Generator().manual_seed(seed + i) for i in range(n)]
    picture = Image.open(io.BytesIO(image)).convert("RGB")
    images = pipe(
        image=picture,
        prompt=prompt,
        num_images_per_prompt=n,
        num_inference_steps=STEPS,
        generator=generators,
        **kw,
    ).images
    return np.stack([np.asarray(i) for i in images])


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
    images = []
    tensors = {"image": np.frombuffer(image, dtype=np.uint8)}
    async for _, frame in deployed.orchestrator.generate_chain(request, [Modality.IMAGE], tensors=tensors):
        if isinstance(frame, TensorFrame):
            images.append(np.asarray(frame.tensors[IMAGES_TENSOR]))
    (batch,) = images
    return batch


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
    image, prompt = png(40, 56, seed=1), "make the cat blue"
    n = params.get("n", 1)
    extra = {k: params[k] for k in ("negative_prompt", "true_cfg_scale", "width", "height") if k in params}
    expected = direct(diffusers_pipe, image, prompt, seed=params["seed"], n=n, **extra)
    assert expected.shape == (n, params["height"], params["width"], 3)
    assert len(np.unique(expected)) > 50
    assert np.array_equal(await edit(split, image, prompt, **params), expected)
    assert np.array_equal(await edit(whole, image, prompt, **params), expected)


async def test_without_a_size_the_output_has_the_pipelines_size_for_the_input(
    split: Deployed, diffusers_pipe: Any
) -> None:
    """No size: the pipeline's own (the input's aspect ratio at about one megapixel, here 864x1216)."""
    image = png(28, 20, seed=2)
    expected = direct(diffusers_pipe, image, "a red cat", seed=3)
    assert expected.shape == (1, 864, 1216, 3)
    assert np.array_equal(await edit(split, image, "a red cat", seed=3), expected)


async def test_the_seed_and_the_input_image_decide_the_result(split: Deployed) -> None:
    image = png(32, 32, seed=4)
    a = await edit(split, image, "a red cat", seed=5, width=32, height=32)
    assert np.array_equal(a, await edit(split, image, "a red cat", seed=5, width=32, height=32))
    assert not np.array_equal(a, await edit(split, image, "a red cat", seed=6, width=32, height=32))
    assert not np.array_equal(a, await edit(split, png(32, 32, seed=5), "a red cat", seed=5, width=32, height=32))


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


async def test_an_undecodable_image_or_a_wrong_declared_size_is_a_400_naming_the_image(split: Deployed) -> None:
    with pytest.raises(StageError) as err:
        await edit(split, b"\x89PNG\r\n\x1a\nnot really", "a cat", source=(32, 32), seed=1, width=32, height=32)
    assert (err.value.status, err.value.param) == (400, "image")
    with pytest.raises(StageError) as err:
        await edit(split, png(32, 32, seed=1), "a cat", source=(64, 32), seed=1, width=32, height=32)
    assert (err.value.status, err.value.param) == (400, "image")
    assert "32x32" in err.value.message
