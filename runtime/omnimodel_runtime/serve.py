"""The ``omnimodel serve`` process: the gateway app with every stage's engine in this same process.

Stages are :class:`~omnimodel_runtime.stage.local.LocalStage` handles (frames pass in memory, no
serialisation); the OpenAI routes are the gateway's own (:func:`~omnimodel_runtime.gateway.app.build_app`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any, Final

from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from omnimodel_runtime.engines.registry import load_engine
from omnimodel_runtime.gateway.app import build_app
from omnimodel_runtime.metrics import StageMetricsFamily
from omnimodel_runtime.pipeline import (
    EngineName,
    ModelSource,
    Pipeline,
    PipelineError,
    get_preset,
    validation_problems,
)
from omnimodel_runtime.settings import RuntimeSettings
from omnimodel_runtime.stage.handle import StageHandle
from omnimodel_runtime.stage.local import LocalStage
from omnimodel_runtime.tiny import TINY_BUILDERS


def build_serve_app(settings: RuntimeSettings, pipeline: Pipeline) -> FastAPI:
    """Every stage in this process as a :class:`LocalStage`. Stage metrics share the gateway's
    registry, so one ``/metrics`` shows both."""
    registry = CollectorRegistry()
    family = StageMetricsFamily(registry)
    handles: dict[str, StageHandle] = {}
    for stage in pipeline.stages:
        metrics = family.for_stage(stage.name)
        loader = partial(load_engine, stage, pipeline.model, settings, metrics)
        handles[stage.name] = LocalStage(stage, loader, metrics)
    return build_app(settings, pipeline, handles, registry=registry)


# ``omnimodel serve`` and ``omnimodel pipeline`` run a stage whose preset engine is vLLM on transformers
# unless told otherwise: transformers comes with the ``transformers`` extra every preset needs and starts
# in seconds, vLLM needs its own extra (and a GPU to be worth it). Clusters keep the preset's default: the
# operator renders vLLM for them. Logged at start-up, so the choice is never silent.
LOCAL_ENGINE_DEFAULTS: Final = {EngineName.VLLM: EngineName.TRANSFORMERS}


def serve_pipeline(
    preset: str,
    model: str,
    *,
    engines: Sequence[str] = (),
    engine_args: dict[str, Any] | None = None,
    served_model_name: str | None = None,
    device: str = "auto",
    endpoints: Mapping[str, Sequence[str]] | None = None,
    local_defaults: bool = False,
) -> Pipeline:
    """The pipeline ``omnimodel serve`` runs: ``preset`` bound to ``model`` with per-stage overrides.

    ``engines`` items are ``ENGINE`` (every stage) or ``STAGE=ENGINE``. In one process every stage runs
    where the process runs, so on ``device="cpu"`` each stage's accelerator becomes the CPU; otherwise
    the preset's accelerators stay (they only matter to the operator). ``endpoints`` gives stages their
    URLs (a pipeline file for split mode); ``local_defaults`` applies :data:`LOCAL_ENGINE_DEFAULTS` to the
    stages ``engines`` does not name.
    """
    p = get_preset(preset)
    _check_tiny_model(preset, model)
    overrides: dict[str, dict[str, Any]] = {name: {} for name in p.stage_names}
    for item in engines:
        stage, sep, engine = item.rpartition("=")
        for name in [stage] if sep else p.stage_names:
            overrides.setdefault(name, {})["engine"] = engine
    for stage_def in p.stages:
        chosen = overrides[stage_def.name]
        if local_defaults and "engine" not in chosen and stage_def.engine in LOCAL_ENGINE_DEFAULTS:
            chosen["engine"] = LOCAL_ENGINE_DEFAULTS[stage_def.engine].value
        if device == "cpu":
            chosen["accelerator"] = {"vendor": "cpu"}
        if engine_args:
            chosen["engine_args"] = {**stage_def.engine_args, **engine_args}
    for name, urls in (endpoints or {}).items():
        overrides.setdefault(name, {})["endpoints"] = tuple(urls)
    try:
        return p.pipeline(ModelSource(source=model, served_name=served_model_name), overrides=overrides)
    except ValidationError as err:  # a bad override value (e.g. an unknown engine name)
        raise PipelineError(validation_problems(err)) from None


def _check_tiny_model(preset: str, model: str) -> None:
    """``tiny://X`` is preset X's tiny model: with another preset it cannot load (a one-line error now
    rather than an engine's traceback later)."""
    scheme, sep, name = model.partition("://")
    if scheme != "tiny" or not sep or name == preset or name not in TINY_BUILDERS:
        return
    if name.startswith(f"{preset}-"):  # a variant of the preset's own tiny model (qwen2.5-omni-vllm-omni)
        return
    raise PipelineError(
        [("model", f"{model} is the tiny model of preset {name!r}; --preset {preset} needs tiny://{preset}")]
    )
