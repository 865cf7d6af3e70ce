"""Which adapter class runs which (engine, task) pair, imported only when a stage needs it.

The operator image and the gateway never import torch: adapters are named by module path and loaded
lazily; a missing library becomes an error that names the pip extra to install.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from omnimodel_runtime.engines.base import Engine, EngineContext, EngineMetrics, NullMetrics
from omnimodel_runtime.errors import ExtraMissingError, RuntimeSetupError
from omnimodel_runtime.models import resolve_model_dir
from omnimodel_runtime.pipeline import ENGINE_TASKS, EngineName, ModelSource, Stage
from omnimodel_runtime.settings import RuntimeSettings


@dataclass(frozen=True)
class AdapterRef:
    module: str
    cls: str
    extra: str


ADAPTERS: Final[Mapping[tuple[EngineName, str], AdapterRef]] = {
    (EngineName.TRANSFORMERS, "text-generation"): AdapterRef(
        "omnimodel_runtime.engines.text.transformers", "TransformersTextEngine", "transformers"
    ),
    (EngineName.VLLM, "text-generation"): AdapterRef("omnimodel_runtime.engines.text.vllm", "VllmTextEngine", "vllm"),
    (EngineName.TRANSFORMERS, "tts-acoustic"): AdapterRef(
        "omnimodel_runtime.engines.tts.acoustic", "SpeechT5AcousticEngine", "tts"
    ),
    (EngineName.TRANSFORMERS, "tts-vocoder"): AdapterRef(
        "omnimodel_runtime.engines.tts.vocoder", "HifiGanVocoderEngine", "tts"
    ),
    (EngineName.TRANSFORMERS, "omni-thinker"): AdapterRef(
        "omnimodel_runtime.engines.omni.thinker", "OmniThinkerEngine", "transformers"
    ),
    (EngineName.TRANSFORMERS, "omni-talker"): AdapterRef(
        "omnimodel_runtime.engines.omni.talker", "OmniTalkerEngine", "transformers"
    ),
    (EngineName.TRANSFORMERS, "omni-code2wav"): AdapterRef(
        "omnimodel_runtime.engines.omni.code2wav", "OmniCode2WavEngine", "transformers"
    ),
    **{
        (EngineName.TRANSFORMERS, f"qwen3-omni-{part}"): AdapterRef(
            "omnimodel_runtime.engines.omni.qwen3", f"Qwen3{cls}Engine", "transformers"
        )
        for part, cls in (("thinker", "Thinker"), ("talker", "Talker"), ("code2wav", "Code2Wav"))
    },
    # One adapter, four roles: the whole pipeline in one stage, or one stage of encode -> denoise -> decode
    # (of text to image, or of an image edit).
    **{
        (EngineName.DIFFUSERS, task): AdapterRef(
            "omnimodel_runtime.engines.t2i.diffusers", "DiffusersImageEngine", "diffusers"
        )
        for task in ENGINE_TASKS[EngineName.DIFFUSERS]
        if task != "text-to-video"
    },
    (EngineName.DIFFUSERS, "text-to-video"): AdapterRef(
        "omnimodel_runtime.engines.t2v.diffusers", "DiffusersVideoEngine", "diffusers"
    ),
}


def supported() -> list[tuple[str, str]]:
    """(engine, task) pairs this runtime can serve."""
    return [(engine.value, task) for engine, task in ADAPTERS]


def engine_class(engine: EngineName, task: str) -> type[Engine]:
    """Import and return the adapter for ``engine`` running ``task``."""
    ref = ADAPTERS.get((engine, task))
    if ref is None:
        known = ", ".join(f"{e}/{t}" for e, t in supported())
        raise RuntimeSetupError(f"no engine adapter for engine {engine.value!r} and task {task!r} (known: {known})")
    try:
        module = importlib.import_module(ref.module)
    except ImportError as err:
        raise ExtraMissingError(what=f"the {engine.value} engine", extra=ref.extra, cause=err) from err
    cls: type[Engine] = getattr(module, ref.cls)
    return cls


def create_engine(context: EngineContext) -> Engine:
    """Instantiate the adapter for ``context.stage`` (loading happens in ``start``)."""
    return engine_class(context.stage.engine, context.stage.task)(context)


async def load_engine(
    stage: Stage, model: ModelSource, settings: RuntimeSettings, metrics: EngineMetrics | None = None
) -> Engine:
    """Resolve the model directory (possibly building a tiny model or downloading; off the event loop)
    and instantiate the stage's adapter. The engine still needs ``start()``."""
    model_dir = await asyncio.to_thread(resolve_model_dir, model, settings, stage)
    context = EngineContext(stage=stage, model_dir=model_dir, settings=settings, metrics=metrics or NullMetrics())
    return create_engine(context)
