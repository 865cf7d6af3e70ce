"""The ``omnimodel serve`` process: the gateway app with every stage's engine in this same process.

Stages are :class:`~omnimodel_runtime.stage.local.LocalStage` handles (frames pass in memory, no
serialisation); the OpenAI routes are the gateway's own (:func:`~omnimodel_runtime.gateway.app.build_app`).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from omnimodel_runtime.engines.registry import load_engine
from omnimodel_runtime.gateway.app import build_app
from omnimodel_runtime.metrics import StageMetricsFamily
from omnimodel_runtime.pipeline import ModelSource, Pipeline, PipelineError, get_preset, validation_problems
from omnimodel_runtime.settings import RuntimeSettings
from omnimodel_runtime.stage.handle import StageHandle
from omnimodel_runtime.stage.local import LocalStage


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


def serve_pipeline(
    preset: str,
    model: str,
    *,
    engines: Sequence[str] = (),
    engine_args: dict[str, Any] | None = None,
    served_model_name: str | None = None,
    device: str = "auto",
) -> Pipeline:
    """The pipeline ``omnimodel serve`` runs: ``preset`` bound to ``model`` with per-stage overrides.

    ``engines`` items are ``ENGINE`` (every stage) or ``STAGE=ENGINE``. In one process every stage runs
    where the process runs, so on ``device="cpu"`` each stage's accelerator becomes the CPU; otherwise
    the preset's accelerators stay (they only matter to the operator).
    """
    p = get_preset(preset)
    overrides: dict[str, dict[str, Any]] = {name: {} for name in p.stage_names}
    for item in engines:
        stage, sep, engine = item.rpartition("=")
        for name in [stage] if sep else p.stage_names:
            overrides.setdefault(name, {})["engine"] = engine
    for stage_def in p.stages:
        if device == "cpu":
            overrides[stage_def.name]["accelerator"] = {"vendor": "cpu"}
        if engine_args:
            overrides[stage_def.name]["engine_args"] = {**stage_def.engine_args, **engine_args}
    try:
        return p.pipeline(ModelSource(source=model, served_name=served_model_name), overrides=overrides)
    except ValidationError as err:  # a bad override value (e.g. an unknown engine name)
        raise PipelineError(validation_problems(err)) from None
