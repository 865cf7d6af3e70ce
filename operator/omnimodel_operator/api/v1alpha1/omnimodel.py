"""The whole object: ``OmniModelSpec`` (the cross-field rules between model, preset, runtime and stages)
and ``OmniModel``."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from omnimodel_operator.api.v1alpha1.base import CATALOGUE, MAX_STAGES, SINGLE_STAGE, FreeForm, KubeModel
from omnimodel_operator.api.v1alpha1.model import ModelSpec
from omnimodel_operator.api.v1alpha1.rules import SPEC_RULES
from omnimodel_operator.api.v1alpha1.runtime import GatewaySpec, RuntimeSpec
from omnimodel_operator.api.v1alpha1.stage import StageSpec
from omnimodel_operator.api.v1alpha1.status import OmniModelStatus
from omnimodel_runtime.pipeline import PRESETS


class OmniModelSpec(KubeModel):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": SPEC_RULES})

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
