"""``spec.stages[]``: one stage's engine, placement, replicas and autoscaling."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, WithJsonSchema, model_validator

from omnimodel_operator.api.v1alpha1.base import (
    ALL_TASKS,
    DEFAULT_AUTOSCALING_TARGETS,
    MAX_INPUTS,
    RESERVED_STAGE_NAMES,
    DnsLabel,
    FreeForm,
    KubeModel,
    Quantity,
    cel,
    cel_list,
)
from omnimodel_operator.api.v1alpha1.runtime import EnvVar, Resources, Toleration
from omnimodel_runtime.pipeline import ENGINE_TASKS, EngineName, Modality, StageKind, Vendor

# Free-form, but with the keys the CEL rules read declared: an undeclared field of a preserve-unknown-fields
# object is invisible to CEL (the API server refuses the rule at compile time).
EngineArgs = Annotated[
    dict[str, Any],
    WithJsonSchema(
        {
            "type": "object",
            "x-kubernetes-preserve-unknown-fields": True,
            "properties": {
                key: {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True}
                for key in ("devices", "num_replicas", "tensor_parallel_size")
            },
        }
    ),
]


class Accelerator(KubeModel):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "self.vendor == 'cpu' || !has(self.count) || self.count >= 1",
                    "accelerator.count must be at least 1 for a device vendor",
                    ".count",
                ),
                cel(
                    "self.vendor != 'cpu' || ((!has(self.count) || self.count == 0) && !has(self.product))",
                    "a cpu accelerator takes neither count nor product",
                ),
            ]
        }
    )

    vendor: Vendor = Field(description="nvidia, amd, intel, ascend or cpu (no device).")
    product: str | None = Field(
        default=None,
        min_length=1,
        max_length=63,
        description="Product to pin to by node label, e.g. H200 (nvidia.com/gpu.product=NVIDIA-H200), "
        "MI300X, 910B. Unset = any product of the vendor.",
    )
    count: int | None = Field(
        default=None, ge=0, le=64, description="Devices per replica. Default 1 for device vendors."
    )


class ScalingRatio(KubeModel):
    stage: DnsLabel = Field(description="Another stage of this OmniModel.")
    min: float | None = Field(default=None, ge=0, le=1000, description="At least min x that stage's replicas.")
    max: float | None = Field(default=None, ge=0, le=1000, description="At most max x that stage's replicas.")


class Autoscaling(KubeModel):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    # has(): minReplicas is optional (default 1), and CEL fails on an absent field.
                    "(has(self.minReplicas) ? self.minReplicas : 1) <= self.maxReplicas",
                    "autoscaling.minReplicas (default 1) must not exceed maxReplicas",
                    ".minReplicas",
                ),
                cel(
                    "!has(self.metric) || self.metric != 'cpu' || (has(self.provider) && self.provider == 'hpa')",
                    "metric cpu is scaled by a HorizontalPodAutoscaler: set provider: hpa",
                    ".metric",
                ),
                cel(
                    "!has(self.minReplicas) || self.minReplicas > 0 || !has(self.provider) "
                    "|| self.provider == 'operator'",
                    "scaling to zero needs provider operator (a HorizontalPodAutoscaler keeps at least one pod)",
                    ".minReplicas",
                ),
                cel(
                    "!has(self.provider) || self.provider != 'hpa' || !has(self.metric) "
                    "|| self.metric != 'pendingSeconds'",
                    "pendingSeconds is read by the operator's autoscaler: "
                    "provider hpa takes inFlight, queueDepth or cpu",
                    ".metric",
                ),
                cel(
                    "!has(self.ratio) || has(self.ratio.min) || has(self.ratio.max)",
                    "autoscaling.ratio needs min, max or both",
                    ".ratio",
                ),
            ]
        }
    )

    min_replicas: int = Field(
        default=1,
        ge=0,
        le=1000,
        description="Lower bound. Default 1. 0 lets an idle stage go to zero after idleSecondsToZero; "
        "the gateway then holds a request that needs it (up to wakeTimeoutSeconds) until a replica is ready "
        "(provider operator, runtime.kind omnimodel only).",
    )
    max_replicas: int = Field(ge=1, le=1000, description="Upper bound.")
    provider: Literal["operator", "hpa"] = Field(
        default="operator",
        description="operator: the operator's own autoscaler reads the runtime's signals (nothing to "
        "install) and sets the Deployment's replicas through its scale subresource. hpa: an "
        "autoscaling/v2 HorizontalPodAutoscaler (metric cpu from metrics-server, or a Pods metric "
        "served by prometheus-adapter; see docs/autoscaling.md). Default operator.",
    )
    metric: Literal["inFlight", "queueDepth", "pendingSeconds", "cpu"] | None = Field(
        default=None,
        description="What one replica should carry at most (target). inFlight: requests the gateways have "
        "in flight on the stage, on average since the last decision; queueDepth: requests queued at the "
        "stage (vLLM-Omni: its stage_waiting_requests); pendingSeconds: that average in flight x the stage's "
        "mean request time (seconds of work waiting); cpu: utilisation percent (provider hpa). Default: "
        "pendingSeconds for diffusion stages, queueDepth for vLLM-Omni stages, inFlight otherwise.",
    )
    target: float | None = Field(
        default=None,
        gt=0,
        le=100000,
        description="Target per replica. Default: inFlight 4, queueDepth 4, pendingSeconds 10, cpu 80.",
    )
    scale_up_window_seconds: int = Field(
        default=0, ge=0, le=3600, description="Scale up to the lowest recommendation of this window. Default 0."
    )
    scale_down_window_seconds: int = Field(
        default=120,
        ge=0,
        le=3600,
        description="Scale down only to the highest recommendation of this window, so a brief lull "
        "does not drop replicas that the next burst needs. Default 120.",
    )
    idle_seconds_to_zero: int = Field(
        default=300, ge=0, le=86400, description="With minReplicas 0: seconds without load before 0. Default 300."
    )
    wake_timeout_seconds: int = Field(
        default=300,
        ge=1,
        le=3600,
        description="With minReplicas 0: how long the gateway holds a request for this stage while it has no "
        "ready replica (the hold is the signal that wakes it); past that the request fails with 503 naming "
        "the stage. Default 300.",
    )
    ratio: ScalingRatio | None = Field(
        default=None,
        description="Keep this stage's replicas within min..max times another stage's (e.g. two talkers "
        "per thinker at most).",
    )

    @model_validator(mode="after")
    def _checked(self) -> Autoscaling:
        # The CEL rules above, again, for objects that never went through the API server.
        if self.min_replicas > self.max_replicas:
            raise ValueError("autoscaling.minReplicas (default 1) must not exceed maxReplicas")
        if self.metric == "cpu" and self.provider != "hpa":
            raise ValueError("metric cpu is scaled by a HorizontalPodAutoscaler: set provider: hpa")
        if self.min_replicas == 0 and self.provider != "operator":
            raise ValueError("scaling to zero needs provider operator (a HorizontalPodAutoscaler keeps one pod)")
        if self.metric == "pendingSeconds" and self.provider == "hpa":
            raise ValueError("pendingSeconds is read by the operator's autoscaler, not by an HPA")
        if self.ratio is not None and self.ratio.min is None and self.ratio.max is None:
            raise ValueError("autoscaling.ratio needs min, max or both")
        return self

    def target_for(self, metric: str) -> float:
        return self.target if self.target is not None else DEFAULT_AUTOSCALING_TARGETS[metric]


class Disruption(KubeModel):
    min_available: Quantity = Field(
        description="PodDisruptionBudget minAvailable for this stage (count or percentage)."
    )


class StageSpec(KubeModel):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "!(has(self.replicas) && has(self.autoscaling))",
                    "replicas and autoscaling are mutually exclusive: autoscaling owns the replica count",
                    ".replicas",
                ),
                cel(
                    "!(self.name in " + cel_list(RESERVED_STAGE_NAMES) + ")",
                    "stage names " + ", ".join(RESERVED_STAGE_NAMES) + " are reserved for the OmniModel's own "
                    "children (<name>-gateway, <name>-pipeline, <name>-runtime)",
                    ".name",
                ),
                cel(
                    "!has(self.engine) || !has(self.task) || "
                    + " || ".join(
                        f"(self.engine == '{e.value}' && self.task in {cel_list(t)})" for e, t in ENGINE_TASKS.items()
                    ),
                    "the engine does not run this task: "
                    + "; ".join(f"{e.value} runs {', '.join(t)}" for e, t in ENGINE_TASKS.items()),
                    ".task",
                ),
            ]
        }
    )

    name: DnsLabel = Field(description="Stage name; a preset's stage name overrides that stage.")
    engine: EngineName | None = Field(default=None, description="vllm, transformers or diffusers.")
    kind: StageKind | None = Field(
        default=None,
        description="ar, generation, diffusion, encoder, decoder or vocoder. Only for graphs without a preset.",
    )
    task: Literal[ALL_TASKS] | None = Field(  # type: ignore[valid-type]
        default=None,
        description="What the engine does: "
        + "; ".join(f"{e.value}: {', '.join(t)}" for e, t in ENGINE_TASKS.items())
        + ". Only for graphs without a preset.",
    )
    inputs: list[DnsLabel] | None = Field(
        default=None,
        max_length=MAX_INPUTS,
        description="Upstream stages. Only for graphs without a preset; must name stages listed earlier.",
    )
    outputs: list[Modality] | None = Field(
        default=None,
        max_length=3,
        description="Modalities this stage returns to the client. Only for graphs without a preset.",
    )
    replicas: int | None = Field(default=None, ge=0, le=1000, description="Pods for this stage. Default 1.")
    accelerator: Accelerator | None = Field(default=None, description="Devices per replica.")
    resources: Resources | None = Field(
        default=None,
        description="CPU/memory requests and limits. A resource not requested here is requested at the "
        "operator's default (its stage requests plus its per-device requests for each device of a replica; a "
        "stage without devices of an hf:// model fetched into a cache requests memory of at least its files' "
        "size plus 1Gi once the fetch reports it, status.weights.stageBytes), or at its limit when only "
        "limited here; a requested resource not limited here is limited to a multiple of its request (by "
        "default memory 1x, CPU 4x). Device limits come from accelerator.",
    )
    node_selector: dict[str, str] | None = Field(
        default=None, description="Extra node labels, merged over the accelerator's product label."
    )
    tolerations: list[Toleration] | None = Field(
        default=None, max_length=32, description="Extra tolerations, added to the accelerator's."
    )
    affinity: FreeForm | None = Field(default=None, description="A Kubernetes Affinity, used as given.")
    env: list[EnvVar] | None = Field(default=None, max_length=64, description="Extra environment.")
    engine_args: EngineArgs | None = Field(
        default=None,
        description="Keyword arguments for the engine (e.g. tensor_parallel_size), handed through as given. "
        "devices, num_replicas and tensor_parallel_size are named in the schema (integer or string) only so that "
        "the vLLM-Omni rules can read them.",
    )
    autoscaling: Autoscaling | None = Field(default=None, description="HorizontalPodAutoscaler bounds.")
    disruption: Disruption | None = Field(default=None, description="PodDisruptionBudget for this stage.")

    @model_validator(mode="after")
    def _checked(self) -> StageSpec:
        # The same rules as the CEL above, for objects that never went through the API server.
        if self.name in RESERVED_STAGE_NAMES:
            raise ValueError(f"stage name {self.name!r} is reserved ({', '.join(RESERVED_STAGE_NAMES)})")
        if self.engine is not None and self.task is not None and self.task not in ENGINE_TASKS[self.engine]:
            raise ValueError(
                f"engine {self.engine.value} does not run task {self.task!r} "
                f"(it runs {', '.join(ENGINE_TASKS[self.engine])})"
            )
        if self.replicas is not None and self.autoscaling is not None:
            raise ValueError("replicas and autoscaling are mutually exclusive: autoscaling owns the replica count")
        return self
