"""The CEL rules of ``spec`` as a whole: how model, preset, runtime and stages must fit together.

Each rule names the field it is about (``fieldPath``) and is checked again by the operator
(:mod:`omnimodel_operator.resolve`, :mod:`omnimodel_operator.vllm_omni.plan` and the model validators),
for objects that never went through an API server. Map literals are generated from the preset table and
the committed vLLM-Omni catalogue, so the rules never drift from what the operator renders.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from pydantic import JsonValue

from omnimodel_operator.api.v1alpha1.base import CATALOGUE, SINGLE_STAGE, TINY_MODELS, cel, cel_list
from omnimodel_runtime.pipeline import ENGINE_TASKS, PRESETS

VLLM: Final = "has(self.runtime) && has(self.runtime.kind) && self.runtime.kind == 'vllm-omni'"
_NAMES: Final = "self.stages.map(t, t.name)"
# engineArgs keys the operator sets for vLLM-Omni stages (devices from the accelerator, replicas from
# spec.stages[].replicas); vllm_omni.plan refuses them too.
OPERATOR_ENGINE_ARGS: Final = ("devices", "num_replicas")


def _cel_map(entries: Iterable[tuple[str, str]]) -> str:
    return "{" + ", ".join(f"'{k}': {v}" for k, v in entries) + "}"


def _vllm_omni_stage_map() -> str:
    """CEL map literal deploy config → stage names, from the committed catalogue."""
    return _cel_map((c.name, cel_list(tuple(s.name for s in c.stages))) for c in CATALOGUE.configs)


def _preset_stage_map() -> str:
    """CEL map literal preset → stage names, from the preset table so the two never drift."""
    return _cel_map((name, cel_list(preset.stage_names)) for name, preset in PRESETS.items())


def preset_engines() -> dict[str, dict[str, tuple[str, ...]]]:
    """preset → stage → the engines that run that stage's task (what an engine override may choose)."""
    return {
        name: {s.name: tuple(e.value for e, tasks in ENGINE_TASKS.items() if s.task in tasks) for s in preset.stages}
        for name, preset in PRESETS.items()
    }


def tiny_models_of(preset: str) -> tuple[str, ...]:
    """The tiny:// models a preset's graph loads: its own and its variants."""
    return tuple(name for name, of in TINY_MODELS.items() if of == preset)


def vllm_omni_heads() -> dict[str, str]:
    """deploy config → the stage the head pod runs (the entry stage)."""
    return {c.name: c.head_stage.name for c in CATALOGUE.configs}


def vllm_omni_devices() -> dict[str, dict[str, tuple[int, int]]]:
    """deploy config → stage → (devices per replica, tensor-parallel size) where not (1, 1)."""
    out: dict[str, dict[str, tuple[int, int]]] = {}
    for c in CATALOGUE.configs:
        odd = {s.name: (s.devices_per_replica, s.tensor_parallel_size) for s in c.stages}
        odd = {k: v for k, v in odd.items() if v != (1, 1)}
        if odd:
            out[c.name] = odd
    return out


def _vllm_omni_devices_map() -> str:
    """CEL map literal '<deploy config>/<stage>' → [devices per replica, tensor-parallel size], for the
    stages where that is not [1, 1] (most are, so the rule's literal stays small)."""
    return _cel_map(
        (f"{c}/{s}", f"[{dpr}, {tp}]") for c, stages in vllm_omni_devices().items() for s, (dpr, tp) in stages.items()
    )


_HEAD: Final = (
    f"(has(self.runtime.deployConfig) ? {_cel_map((k, repr(v)) for k, v in vllm_omni_heads().items())}"
    f"[self.runtime.deployConfig] : '{SINGLE_STAGE}')"
)
_KEY: Final = "self.runtime.deployConfig + '/' + s.name"
# [devices per replica, tensor-parallel size] of stage s in the catalogue.
_DPR_TP: Final = (
    f"(has(self.runtime.deployConfig) && ({_KEY}) in {_vllm_omni_devices_map()} ? "
    f"{_vllm_omni_devices_map()}[{_KEY}] : [1, 1])"
)
_TP: Final = "int(s.engineArgs.tensor_parallel_size)"
# What one replica of stage s uses: devices per replica, scaled by engineArgs.tensor_parallel_size when set
# (vllm_omni.plan computes the same).
_PER_REPLICA: Final = (
    f"{_DPR_TP}[0] * (has(s.engineArgs) && has(s.engineArgs.tensor_parallel_size) ? {_TP} : {_DPR_TP}[1]) / "
    f"{_DPR_TP}[1]"
)


def _engine_choices() -> str:
    return "; ".join(
        f"{preset} {stage}: {' or '.join(engines)}"
        for preset, stages in preset_engines().items()
        for stage, engines in stages.items()
    )


def _preset_engines_map() -> str:
    """CEL map literal '<preset>/<stage>' → engines that run the stage's task (flat: the cost estimator
    cannot bound the lists of a nested map literal)."""
    return _cel_map((f"{p}/{n}", cel_list(e)) for p, stages in preset_engines().items() for n, e in stages.items())


TINY_SOURCES: Final = tuple(f"tiny://{name}" for name in TINY_MODELS)

SPEC_RULES: Final[list[JsonValue]] = [
    cel(
        f"({VLLM}) || has(self.preset) || (has(self.stages) && size(self.stages) > 0)",
        "spec.stages must describe the graph when no preset is given",
        ".stages",
    ),
    cel(
        f"!({VLLM}) || !has(self.preset)",
        "runtime.kind vllm-omni takes its stage graph from runtime.deployConfig, not a preset",
        ".preset",
    ),
    cel(
        f"!({VLLM}) || !has(self.stages) || (has(self.runtime.deployConfig) ? "
        f"self.stages.all(s, s.name in {_vllm_omni_stage_map()}[self.runtime.deployConfig]) : "
        f"self.stages.all(s, s.name == '{SINGLE_STAGE}'))",
        "with runtime.kind vllm-omni, every stage must be named like one of the deploy config's stages "
        f"({SINGLE_STAGE} without a deploy config)",
        ".stages",
    ),
    cel(
        f"!({VLLM}) || !has(self.stages) || self.stages.all(s, "
        "!has(s.inputs) && !has(s.kind) && !has(s.task) && !has(s.outputs) && !has(s.engine))",
        "a vLLM-Omni deploy config fixes the graph and its engines: its stages cannot set "
        "engine, inputs, kind, task or outputs",
        ".stages",
    ),
    cel(
        f"!({VLLM}) || !has(self.stages) || self.stages.all(s, !has(s.autoscaling) || "
        "!has(s.autoscaling.minReplicas) || s.autoscaling.minReplicas > 0)",
        "with runtime.kind vllm-omni a stage cannot scale to zero: vLLM-Omni's head does not "
        "hold requests for a stage without replicas",
        ".stages",
    ),
    cel(
        f"!({VLLM}) || !has(self.gateway) || !has(self.gateway.replicas) || self.gateway.replicas == 1",
        "with runtime.kind vllm-omni the head pod serves the API: gateway.replicas must be 1",
        ".gateway.replicas",
    ),
    cel(
        f"!has(self.preset) || !has(self.stages) || self.stages.all(s, s.name in {_preset_stage_map()}[self.preset])",
        "with a preset, every stage must be named like one of the preset's stages",
        ".stages",
    ),
    cel(
        "!has(self.preset) || !has(self.stages) || self.stages.all(s, "
        "!has(s.inputs) && !has(s.kind) && !has(s.task) && !has(s.outputs))",
        "a preset fixes the graph: its stages cannot set inputs, kind, task or outputs",
        ".stages",
    ),
    cel(
        f"({VLLM}) || has(self.preset) || !has(self.stages) || "
        "self.stages.all(s, has(s.engine) && has(s.kind) && has(s.task))",
        "without a preset every stage needs engine, kind and task",
        ".stages",
    ),
    cel(
        f"!has(self.stages) || self.stages.all(s, !has(s.inputs) || s.inputs.all(i, i in {_NAMES}))",
        "stage inputs must name stages of this OmniModel",
        ".stages",
    ),
    cel(
        # Two-variable comprehensions (index, value) instead of indexOf(): the API
        # server's cost estimator treats indexOf on a mapped list as unbounded.
        "!has(self.stages) || self.stages.all(k, s, !has(s.inputs) || s.inputs.all(i, "
        "!self.stages.exists(t, t.name == i) || self.stages.exists(j, t, j < k && t.name == i)))",
        "stage inputs must name stages listed before it, so the graph has no cycle",
        ".stages",
    ),
    # Inputs the operator could not run, which it used to accept and only fail on later.
    cel(
        "!has(self.preset) || !has(self.stages) || self.stages.all(s, !has(s.engine) || "
        f"!((self.preset + '/' + s.name) in {_preset_engines_map()}) || "
        f"s.engine in {_preset_engines_map()}[self.preset + '/' + s.name])",
        f"with a preset, a stage's engine must run that stage's task: {_engine_choices()}",
        ".stages",
    ),
    cel(
        f"!self.model.source.startsWith('tiny://') || self.model.source in {cel_list(TINY_SOURCES)}",
        f"no such tiny model: tiny:// takes {', '.join(TINY_SOURCES)}",
        ".model.source",
    ),
    cel(
        "!has(self.preset) || !self.model.source.startsWith('tiny://') || self.model.source in "
        + _cel_map((p, cel_list(tuple(f"tiny://{m}" for m in tiny_models_of(p)))) for p in PRESETS)
        + "[self.preset]",
        "a tiny model is built for one preset: with preset P, model.source must be tiny://P",
        ".model.source",
    ),
    # vLLM-Omni: what vllm_omni.plan refuses, said by the API server first.
    cel(
        f"!({VLLM}) || !self.model.source.startsWith('tiny://')",
        "tiny:// models are built by the omnimodel runtime; for runtime.kind vllm-omni give the model as "
        "hf://, pvc:// or file:// (a tiny model made with `omnimodel make-tiny` works as file://)",
        ".model.source",
    ),
    cel(
        f"!({VLLM}) || !has(self.stages) || self.stages.all(s, !has(s.engineArgs) || "
        + " && ".join(f"!has(s.engineArgs.{k})" for k in OPERATOR_ENGINE_ARGS)
        + ")",
        f"with runtime.kind vllm-omni, engineArgs {' and '.join(OPERATOR_ENGINE_ARGS)} are set by the operator: a "
        "pod's devices come from its accelerator, replicas from spec.stages[].replicas",
        ".stages",
    ),
    cel(
        f"!({VLLM}) || !has(self.stages) || self.stages.all(s, !has(s.accelerator) || "
        f"s.accelerator.vendor == 'cpu' || (has(s.accelerator.count) ? s.accelerator.count : 1) == {_PER_REPLICA})",
        "with runtime.kind vllm-omni, a stage's accelerator.count (default 1) must be the devices one replica of "
        "it uses: the deploy config's, scaled by engineArgs.tensor_parallel_size when that is set",
        ".stages",
    ),
    cel(
        f"!({VLLM}) || !has(self.stages) || "
        f"self.stages.all(s, s.name != {_HEAD} || !has(s.replicas) || s.replicas > 0)",
        "with runtime.kind vllm-omni the entry stage runs in the head pod (vLLM-Omni's API server lives there): "
        "its replicas must be at least 1",
        ".stages",
    ),
    cel(
        f"!({VLLM}) || !has(self.stages) || self.stages.all(s, s.name != {_HEAD} || !has(s.autoscaling))",
        "with runtime.kind vllm-omni the entry stage runs in the head pod, which is a single pod: it cannot "
        "autoscale; set replicas instead",
        ".stages",
    ),
]
