"""Helpers for runtime component tests that start stage engines in the test's own process, each behind a
local stage, without the HTTP app: the diffusers stages of a pipeline, and diffusers itself as the
reference they are compared against.

A plain module (not conftest) so test files can import it by its unique name.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from omnimodel_runtime.pipeline import Pipeline
    from omnimodel_runtime.protocol.stage import StageRequest
    from omnimodel_runtime.serving.orchestrator import Orchestrator


@dataclass
class Deployed:
    """The stage engines of a pipeline, each started behind a local stage, and the orchestrator of them."""

    orchestrator: Orchestrator
    engines: dict[str, Any]
    metrics: dict[str, Any] = field(default_factory=dict)


@asynccontextmanager
async def stages_in_process(
    pipeline: Pipeline,
    model_dir: Path,
    *,
    engine_class: type[Any] = object,
    metrics: Callable[[], Any] | None = None,
    **engine_args: Any,
) -> AsyncIterator[Deployed]:
    """Every stage's engine of ``pipeline`` on the CPU from ``model_dir`` (checked: an ``engine_class``),
    each behind a local stage, started together and stopped on the way out. ``engine_args``, when given,
    replace each stage's own; ``metrics`` makes each engine's metrics sink."""
    from prometheus_client import CollectorRegistry

    from omnimodel_runtime.engines.base import EngineContext
    from omnimodel_runtime.engines.registry import create_engine
    from omnimodel_runtime.metrics import StageMetricsFamily
    from omnimodel_runtime.serving.orchestrator import Orchestrator
    from omnimodel_runtime.settings import RuntimeSettings
    from omnimodel_runtime.stage.handle import StageHandle
    from omnimodel_runtime.stage.local import LocalStage

    family = StageMetricsFamily(CollectorRegistry())
    handles: dict[str, StageHandle] = {}
    engines: dict[str, Any] = {}
    sinks: dict[str, Any] = {}
    for declared in pipeline.stages:
        stage = declared.model_copy(update={"engine_args": engine_args}) if engine_args else declared
        if metrics is not None:
            sinks[stage.name] = metrics()
        context = EngineContext(stage=stage, model_dir=model_dir, settings=RuntimeSettings(device="cpu"))
        engine = create_engine(replace(context, metrics=sinks[stage.name]) if sinks else context)
        assert isinstance(engine, engine_class)
        engines[stage.name] = engine
        handles[stage.name] = LocalStage(stage, engine, family.for_stage(stage.name))
    await asyncio.gather(*(h.start() for h in handles.values()))
    try:
        yield Deployed(Orchestrator(pipeline, handles), engines, sinks)
    finally:
        await asyncio.gather(*(h.stop() for h in handles.values()))


async def images_of(deployed: Deployed, request: StageRequest, **tensors: np.ndarray) -> np.ndarray:
    """The one batch of images the chain of ``deployed`` answers ``request`` with (``tensors``: its inputs)."""
    from omnimodel_runtime.pipeline import Modality
    from omnimodel_runtime.protocol.images import IMAGES_TENSOR
    from omnimodel_runtime.protocol.stage import TensorFrame

    chain = deployed.orchestrator.generate_chain(request, [Modality.IMAGE], tensors=tensors or None)
    (batch,) = [np.asarray(f.tensors[IMAGES_TENSOR]) async for _, f in chain if isinstance(f, TensorFrame)]
    return batch


def diffusers_pipeline(name: str, model_dir: Path, **kwargs: Any) -> Any:
    """diffusers' own pipeline class ``name`` loaded from ``model_dir``, its progress bar off."""
    import diffusers

    pipe = getattr(diffusers, name).from_pretrained(model_dir, **kwargs)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def diffusers_images(pipe: Any, prompt: str, *, seed: int, steps: int, n: int = 1, **kwargs: Any) -> np.ndarray:
    """diffusers itself: one call of ``pipe``, per-image generators seeded ``seed + i``, its images stacked."""
    import torch

    generators = [torch.Generator().manual_seed(seed + i) for i in range(n)]
    images = pipe(
        prompt=prompt, num_images_per_prompt=n, num_inference_steps=steps, generator=generators, **kwargs
    ).images
    return np.stack([np.asarray(image) for image in images])


def assert_rounding_only(expected: np.ndarray, got: np.ndarray) -> None:
    """The same images but for rounding: batched GEMMs, padded attention or another kernel sum in another
    order (~1e-7 in float32 before quantisation), so a pixel may land one level off; anything more is
    another image (another request's latents, mask or noise, or another seed's)."""
    diff = np.abs(expected.astype(int) - got.astype(int))
    assert diff.max() <= 1, f"max pixel difference {diff.max()}"
    assert (diff == 0).mean() > 0.999, f"{(diff != 0).mean():.2%} of the values differ"


@contextmanager
def conv3d_calls() -> Iterator[list[str]]:
    """One entry for every 3D convolution PyTorch runs (any ``nn.Conv3d``) while the context is open: its
    class, kernel and input shape, so a failing assertion names the convolution."""
    import torch

    calls: list[str] = []
    conv3d = torch.nn.Conv3d._conv_forward

    def counted(module: Any, *args: Any) -> Any:
        calls.append(f"{type(module).__name__} kernel {tuple(module.kernel_size)} on {tuple(args[0].shape)}")
        return conv3d(module, *args)

    torch.nn.Conv3d._conv_forward = counted  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        torch.nn.Conv3d._conv_forward = conv3d  # type: ignore[method-assign]
