"""The whole object: ``OmniModelSpec`` (the cross-field rules between model, preset, runtime and stages)
and ``OmniModel``."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from omnimodel_operator.api.v1alpha1.base import CATALOGUE, MAX_STAGES, SINGLE_STAGE, FreeForm, KubeModel, cel
from omnimodel_operator.api.v1alpha1.model import ModelSpec
from omnimodel_operator.api.v1alpha1.runtime import GatewaySpec, RuntimeSpec
from omnimodel_operator.api.v1alpha1.stage import StageSpec
from omnimodel_operator.api.v1alpha1.status import OmniModelStatus
from omnimodel_runtime.pipeline import PRESETS


def _vllm_omni_stage_map() -> str:
    """CEL map literal deploy config → stage names, from the committed catalogue."""
    entries = ", ".join(f"'{c.name}': [{', '.join(repr(s.name) for s in c.stages)}]" for c in CATALOGUE.configs)
    return "{" + entries + "}"


_VLLM = "has(self.runtime) && has(self.runtime.kind) && self.runtime.kind == 'vllm-omni'"


def _preset_stage_map() -> str:
    """CEL map literal preset → stage names, generated from the catalogue so the two never drift."""
    entries = ", ".join(
        f"'{name}': [{', '.join(repr(s) for s in preset.stage_names)}]" for name, preset in PRESETS.items()
    )
    return "{" + entries + "}"


_NAMES = "self.stages.map(t, t.name)"


class OmniModelSpec(KubeModel):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    f"({_VLLM}) || has(self.preset) || (has(self.stages) && size(self.stages) > 0)",
                    "spec.stages must describe the graph when no preset is given",
                    ".stages",
                ),
                cel(
                    f"!({_VLLM}) || !has(self.preset)",
                    "runtime.kind vllm-omni takes its stage graph from runtime.deployConfig, not a preset",
                    ".preset",
                ),
                cel(
                    f"!({_VLLM}) || !has(self.stages) || (has(self.runtime.deployConfig) ? "
                    f"self.stages.all(s, s.name in {_vllm_omni_stage_map()}[self.runtime.deployConfig]) : "
                    f"self.stages.all(s, s.name == '{SINGLE_STAGE}'))",
                    "with runtime.kind vllm-omni, every stage must be named like one of the deploy config's stages "
                    f"({SINGLE_STAGE} without a deploy config)",
                    ".stages",
                ),
                cel(
                    f"!({_VLLM}) || !has(self.stages) || self.stages.all(s, "
                    "!has(s.inputs) && !has(s.kind) && !has(s.task) && !has(s.outputs) && !has(s.engine))",
                    "a vLLM-Omni deploy config fixes the graph and its engines: its stages cannot set "
                    "engine, inputs, kind, task or outputs",
                    ".stages",
                ),
                cel(
                    f"!({_VLLM}) || !has(self.stages) || self.stages.all(s, !has(s.autoscaling) || "
                    "!has(s.autoscaling.minReplicas) || s.autoscaling.minReplicas > 0)",
                    "with runtime.kind vllm-omni a stage cannot scale to zero: vLLM-Omni's head does not "
                    "hold requests for a stage without replicas",
                    ".stages",
                ),
                cel(
                    f"!({_VLLM}) || !has(self.gateway) || !has(self.gateway.replicas) || self.gateway.replicas == 1",
                    "with runtime.kind vllm-omni the head pod serves the API: gateway.replicas must be 1",
                    ".gateway.replicas",
                ),
                cel(
                    "!has(self.preset) || !has(self.stages) || "
                    f"self.stages.all(s, s.name in {_preset_stage_map()}[self.preset])",
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
                    f"({_VLLM}) || has(self.preset) || !has(self.stages) || "
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
            ]
        }
    )

    model: ModelSpec = Field(description="The model the pipeline serves.")
    preset: Literal[tuple(PRESETS)] | None = Field(  # type: ignore[valid-type]
        default=None,
        description="Stage-graph template: " + ", ".join(PRESETS) + ". Omit to describe the graph in stages.",
    )
    runtime: RuntimeSpec = Field(default_factory=RuntimeSpec, description="Runtime container settings.")
    gateway: GatewaySpec = Field(default_factory=GatewaySpec, description="The OpenAI-compatible gateway.")
    stages: list[StageSpec] | None = Field(
        default=None,
        max_length=MAX_STAGES,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
        description="Per-stage settings. With a preset, entries override the named preset stages; "
        "without, they are the graph (inputs name earlier stages).",
    )

    @model_validator(mode="after")
    def _vllm_omni_rules(self) -> OmniModelSpec:
        # The CEL rules above, again, for objects that never went through the API server.
        if self.runtime.kind != "vllm-omni":
            return self
        if self.preset is not None:
            raise ValueError("runtime.kind vllm-omni takes its stage graph from runtime.deployConfig, not a preset")
        if self.runtime.deploy_config_ref is not None and self.runtime.deploy_config is None:
            raise ValueError("runtime.deployConfigRef is an overlay on runtime.deployConfig, which must be set")
        if self.runtime.deploy_config is None:
            known = [SINGLE_STAGE]
        else:
            known = [st.name for st in CATALOGUE.get(self.runtime.deploy_config).stages]
        for stage in self.stages or ():
            if stage.name not in known:
                config = self.runtime.deploy_config or "(none: the model's single diffusion stage)"
                raise ValueError(f"deploy config {config} has no stage {stage.name!r} (stages: {', '.join(known)})")
            fixed = [f for f in ("engine", "inputs", "kind", "task", "outputs") if getattr(stage, f) is not None]
            if fixed:
                raise ValueError(f"stage {stage.name}: a vLLM-Omni deploy config fixes {', '.join(fixed)}")
            if stage.autoscaling is not None and stage.autoscaling.min_replicas == 0:
                raise ValueError(
                    f"stage {stage.name}: with runtime.kind vllm-omni a stage cannot scale to zero "
                    "(vLLM-Omni's head does not hold requests for a stage without replicas)"
                )
        if self.gateway.replicas != 1:
            raise ValueError("with runtime.kind vllm-omni the head pod serves the API: gateway.replicas must be 1")
        return self

    @model_validator(mode="after")
    def _ratio_stages(self) -> OmniModelSpec:
        names = {s.name for s in self.stages or ()}
        for stage in self.stages or ():
            ratio = stage.autoscaling.ratio if stage.autoscaling else None
            if ratio is not None and (ratio.stage == stage.name or ratio.stage not in names):
                raise ValueError(
                    f"stage {stage.name}: autoscaling.ratio.stage must name another stage listed in spec.stages"
                )
        return self

    @model_validator(mode="after")
    def _unique_names(self) -> OmniModelSpec:
        # The CRD's list-map already guarantees this on the server; the operator also parses
        # files given to `render`, which never went through the API server.
        names = [s.name for s in self.stages or []]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate stage name(s): {', '.join(dupes)}")
        return self


class OmniModel(KubeModel):
    """The whole object; only ``spec`` and ``status`` are modelled, metadata stays Kubernetes'."""

    model_config = ConfigDict(extra="ignore")

    api_version: str = Field(description="omnimodel.io/v1alpha1")
    kind: str = Field(description="OmniModel")
    metadata: FreeForm = Field(description="Standard object metadata.")
    spec: OmniModelSpec = Field(description="Desired pipeline.")
    status: OmniModelStatus | None = Field(default=None, description="Observed state.")
