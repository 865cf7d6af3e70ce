"""``omnimodel.io/v1alpha1`` OmniModel: spec and status as pydantic models.

These models are the single source of truth: the CRD in ``crds/`` is generated from them
(:mod:`omnimodel_operator.crdgen`), and the operator parses every object through them once per reconcile.
CEL rules live next to the fields they guard (``cel(...)``) so that the API server and the operator
enforce the same invariants.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, WithJsonSchema, model_validator
from pydantic.alias_generators import to_camel

from omnimodel_operator.vllm_omni.catalogue import load_catalogue
from omnimodel_runtime.pipeline import ENGINE_TASKS, PRESETS, EngineName, Modality, StageKind, Vendor
from omnimodel_runtime.pipeline.graph import STAGE_NAME_MAX, STAGE_NAME_PATTERN

_CATALOGUE = load_catalogue()
VLLM_OMNI_VERSION = _CATALOGUE.vllm_omni_version
VLLM_OMNI_CONFIGS = tuple(c.name for c in _CATALOGUE.configs)
# The stage of a vLLM-Omni model served without a deploy config (one diffusion pipeline).
SINGLE_STAGE = "dit"
MAX_STAGES = 16
MAX_INPUTS = 8
# Child names are <cr>-<stage>; these suffixes belong to the OmniModel's own children.
RESERVED_STAGE_NAMES = ("gateway", "pipeline", "runtime")
DEFAULT_AUTOSCALING_TARGETS = {"cpu": 80.0, "queueDepth": 4.0, "inFlight": 4.0, "pendingSeconds": 10.0}
ALL_TASKS = tuple(sorted({t for tasks in ENGINE_TASKS.values() for t in tasks}))


def _cel_list(items: tuple[str, ...]) -> str:
    return "[" + ", ".join(f"'{i}'" for i in items) + "]"


def cel(rule: str, message: str, field_path: str | None = None, reason: str | None = None) -> JsonValue:
    """One ``x-kubernetes-validations`` entry."""
    out: dict[str, JsonValue] = {"rule": rule, "message": message}
    if field_path:
        out["fieldPath"] = field_path
    if reason:
        out["reason"] = reason
    return out


# Kubernetes quantities ("500m", "16Gi", 2): the API server's own int-or-string form.
Quantity = Annotated[
    int | str,
    WithJsonSchema({"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True}),
]
# Free-form objects handed through to Kubernetes or the engine untouched.
FreeForm = Annotated[
    dict[str, Any],
    WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True}),
]
DnsLabel = Annotated[str, Field(pattern=STAGE_NAME_PATTERN, min_length=1, max_length=STAGE_NAME_MAX)]


class KubeModel(BaseModel):
    """camelCase on the wire, snake_case in Python; unknown fields are an error, not silently dropped."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


class ModelCache(KubeModel):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "has(self.pvc) != has(self.storageClassName)",
                    "model.cache names an existing claim (pvc) or a storage class to create one from "
                    "(storageClassName), one of the two",
                ),
                cel(
                    "!has(self.pvc) || (!has(self.size) && !has(self.accessMode))",
                    "model.cache.size and accessMode describe a claim the operator creates: they need "
                    "storageClassName, not pvc",
                ),
            ]
        }
    )

    pvc: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        description="An existing PersistentVolumeClaim to keep the weights in. One fetch Job writes the "
        "model's files into it (only the files the stages need); stage pods mount it read-only and wait "
        "for the fetch instead of downloading. Stages on several nodes need it ReadWriteMany.",
    )
    storage_class_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        description="Create the claim <name>-models from this StorageClass (and delete it with the OmniModel).",
    )
    size: Quantity | None = Field(default=None, description="Size of a created claim. Default 100Gi.")
    access_mode: Literal["ReadWriteMany", "ReadWriteOnce", "ReadWriteOncePod"] | None = Field(
        default=None,
        description="Access mode of a created claim; default ReadWriteMany. ReadWriteOnce works only with "
        "every stage pod (and the fetch) on one node.",
    )

    @model_validator(mode="after")
    def _one_claim(self) -> ModelCache:
        # The CEL rule above, again, for objects that never went through the API server.
        if (self.pvc is None) == (self.storage_class_name is None):
            raise ValueError(
                "model.cache names an existing claim (pvc) or a storage class to create one from "
                "(storageClassName), one of the two"
            )
        if self.pvc is not None and (self.size is not None or self.access_mode is not None):
            raise ValueError(
                "model.cache.size and accessMode describe a claim the operator creates: "
                "they need storageClassName, not pvc"
            )
        return self


class SecretKey(KubeModel):
    name: str = Field(min_length=1, max_length=253, description="Secret in the OmniModel's namespace.")
    key: str = Field(default="token", min_length=1, description="Key holding the value. Default token.")


class ModelSpec(KubeModel):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "!has(self.tokenSecret) || has(self.cache)",
                    "model.tokenSecret reaches only the fetch Job, which needs model.cache; without a cache "
                    "every stage pod would download, and need the token",
                    ".tokenSecret",
                ),
                cel(
                    "(!has(self.tokenSecret) && !has(self.endpoint)) || self.source.startsWith('hf://')",
                    "model.tokenSecret and model.endpoint are for fetching from a Hugging Face hub: they need an "
                    "hf:// source",
                ),
            ]
        }
    )

    source: str = Field(
        min_length=1,
        max_length=512,
        # pvc:// needs a DNS-1123 claim name (it becomes a volume's claimName).
        pattern=r"^((hf|file|tiny)://.+|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/.*)?)$",
        description="Where the weights come from: hf://org/name, pvc://claim/path, file:///path, or "
        "tiny://<preset> for random weights built locally from a small config (tests and demos).",
    )
    revision: str | None = Field(
        default=None,
        description="Hub revision (branch, tag or commit). The fetch resolves it to a commit sha "
        "(status.weights.sha); a changed revision fetches again and rolls the stages.",
    )
    served_name: str | None = Field(
        default=None,
        max_length=256,
        description="Model id clients send in the `model` field. Defaults to the source path.",
    )
    cache: ModelCache | None = Field(
        default=None,
        description="Where hf:// weights are kept for every pod (fetched once). Unset: each stage pod "
        "downloads its own files into its own emptyDir at start (again on every restart).",
    )
    token_secret: SecretKey | None = Field(
        default=None,
        description="A Hugging Face token (Secret key) for private or gated repositories; only the fetch "
        "Job's container gets it (HF_TOKEN), never a stage pod or the gateway. With runtime.kind vllm-omni, "
        "which downloads in its own pods, those pods get it.",
    )
    endpoint: str | None = Field(
        default=None,
        min_length=1,
        max_length=512,
        description="A Hugging Face mirror to fetch from (HF_ENDPOINT of the fetch Job; of every pod with "
        "runtime.kind vllm-omni), e.g. an on-prem olah.",
    )

    @model_validator(mode="after")
    def _token_needs_cache(self) -> ModelSpec:
        if (self.token_secret is not None or self.endpoint is not None) and not self.source.startswith("hf://"):
            raise ValueError(
                "model.tokenSecret and model.endpoint are for fetching from a Hugging Face hub: they need an "
                "hf:// source"
            )
        if self.token_secret is not None and self.cache is None:
            raise ValueError(
                "model.tokenSecret reaches only the fetch Job, which needs model.cache; without a cache "
                "every stage pod would download, and need the token"
            )
        return self


class EnvVar(KubeModel):
    name: str = Field(min_length=1, description="Environment variable name.")
    value: str | None = Field(default=None, description="Literal value.")
    value_from: FreeForm | None = Field(
        default=None, description="A Kubernetes EnvVarSource (secretKeyRef, configMapKeyRef, ...)."
    )


class Toleration(KubeModel):
    key: str | None = Field(default=None, description="Taint key to tolerate; empty with Exists = all.")
    operator: Literal["Exists", "Equal"] | None = Field(default=None, description="Exists or Equal.")
    value: str | None = Field(default=None, description="Taint value for operator Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to tolerate; empty = all effects."
    )
    toleration_seconds: int | None = Field(default=None, description="How long a NoExecute taint is tolerated.")


class Resources(KubeModel):
    limits: dict[str, Quantity] | None = Field(default=None, description="Resource limits (cpu, memory, ...).")
    requests: dict[str, Quantity] | None = Field(default=None, description="Resource requests.")


class DeployConfigRef(KubeModel):
    name: str = Field(min_length=1, max_length=253, description="ConfigMap in the OmniModel's namespace.")
    key: str = Field(default="deploy.yaml", min_length=1, description="Key holding the YAML. Default deploy.yaml.")


class RuntimeSpec(KubeModel):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "!has(self.deployConfigRef) || has(self.deployConfig)",
                    "runtime.deployConfigRef is an overlay on runtime.deployConfig, which must be set",
                    ".deployConfigRef",
                ),
                cel(
                    "(has(self.kind) && self.kind == 'vllm-omni') || "
                    "(!has(self.deployConfig) && !has(self.deployConfigRef) && !has(self.extraArgs))",
                    "runtime.deployConfig, deployConfigRef and extraArgs need runtime.kind vllm-omni",
                    ".kind",
                ),
            ]
        }
    )

    kind: Literal["omnimodel", "vllm-omni"] = Field(
        default="omnimodel",
        description="What runs in the stage pods: omnimodel (this project's runtime: a gateway and one "
        "process per stage) or vllm-omni (vLLM-Omni's own engines: the head pod runs its API server, "
        "orchestrator and the entry stage; every other stage is a Deployment of headless replicas "
        "registering with the head). Default omnimodel.",
    )
    deploy_config: Literal[tuple(VLLM_OMNI_CONFIGS)] | None = Field(  # type: ignore[valid-type]
        default=None,
        description=f"vllm-omni only: one of vLLM-Omni {VLLM_OMNI_VERSION}'s bundled deploy configs (e.g. "
        "qwen2_5_omni, qwen3_omni_moe, qwen3_tts, bagel). It gives the stages (spec.stages[].name must be "
        "its stage names) and the base of the deploy file the operator writes for the pods. Unset: the "
        "model's own single diffusion stage, named dit (diffusers pipelines such as Qwen-Image, FLUX or "
        "SD3, as `vllm serve M --omni` runs them without a deploy config).",
    )
    deploy_config_ref: DeployConfigRef | None = Field(
        default=None,
        description="vllm-omni only: a ConfigMap key holding a deploy YAML, applied by vLLM-Omni as an "
        "overlay (its base_config) on top of the operator's deploy file for deployConfig; the stage "
        "graph stays deployConfig's. Read when the OmniModel is reconciled.",
    )
    extra_args: list[Annotated[str, Field(max_length=1024)]] | None = Field(
        default=None,
        max_length=64,
        description="vllm-omni only: arguments appended to every `vllm serve` command line (head and "
        "replicas), e.g. [--dtype, float32]. Per-stage engine settings belong in spec.stages[].engineArgs.",
    )
    image: str | None = Field(
        default=None,
        min_length=1,
        description="Runtime image for every stage and the gateway. Defaults to the operator's image "
        "for each stage's accelerator vendor (published for nvidia, amd and cpu; intel and ascend have none, "
        "so the operator must be given one or the stage is refused; for vllm-omni, the vLLM-Omni image for "
        "the vendor).",
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = Field(
        default=None, description="Image pull policy for runtime containers."
    )
    env: list[EnvVar] | None = Field(
        default=None, max_length=64, description="Environment for every runtime container."
    )


class GatewaySpec(KubeModel):
    replicas: int = Field(default=1, ge=0, le=1000, description="Gateway pods. Default 1.")
    port: int = Field(default=8000, ge=1, le=65535, description="Service port of the OpenAI API. Default 8000.")
    api_key_secret: str | None = Field(
        default=None,
        min_length=1,
        description="Secret whose `api-key` entry clients must send as a Bearer token. Unset = open.",
    )
    service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = Field(
        default="ClusterIP", description="Type of the gateway Service. Default ClusterIP."
    )
    resources: Resources | None = Field(default=None, description="Gateway container resources.")
    node_selector: dict[str, str] | None = Field(default=None, description="Gateway node selector.")
    tolerations: list[Toleration] | None = Field(default=None, max_length=32, description="Gateway tolerations.")


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
                    "!(self.name in " + _cel_list(RESERVED_STAGE_NAMES) + ")",
                    "stage names " + ", ".join(RESERVED_STAGE_NAMES) + " are reserved for the OmniModel's own "
                    "children (<name>-gateway, <name>-pipeline, <name>-runtime)",
                    ".name",
                ),
                cel(
                    "!has(self.engine) || !has(self.task) || "
                    + " || ".join(
                        f"(self.engine == '{e.value}' && self.task in {_cel_list(t)})" for e, t in ENGINE_TASKS.items()
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
    resources: Resources | None = Field(default=None, description="CPU/memory; device limits come from accelerator.")
    node_selector: dict[str, str] | None = Field(
        default=None, description="Extra node labels, merged over the accelerator's product label."
    )
    tolerations: list[Toleration] | None = Field(
        default=None, max_length=32, description="Extra tolerations, added to the accelerator's."
    )
    affinity: FreeForm | None = Field(default=None, description="A Kubernetes Affinity, used as given.")
    env: list[EnvVar] | None = Field(default=None, max_length=64, description="Extra environment.")
    engine_args: FreeForm | None = Field(
        default=None, description="Keyword arguments for the engine (e.g. tensor_parallel_size)."
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


def _vllm_omni_stage_map() -> str:
    """CEL map literal deploy config → stage names, from the committed catalogue."""
    entries = ", ".join(f"'{c.name}': [{', '.join(repr(s.name) for s in c.stages)}]" for c in _CATALOGUE.configs)
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
            known = [st.name for st in _CATALOGUE.get(self.runtime.deploy_config).stages]
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


# ---------------------------------------------------------------------------------------------- status


class Condition(KubeModel):
    model_config = ConfigDict(extra="ignore")

    type: str = Field(description="Ready, Progressing or Degraded.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(description="UpperCamelCase reason.")
    message: str = Field(default="", description="Human-readable detail.")
    observed_generation: int | None = Field(default=None, description="Generation the condition describes.")
    last_transition_time: str = Field(description="When status last changed (RFC 3339).")


class StatusModel(KubeModel):
    # Status written by an older operator may carry fields this one no longer writes.
    model_config = ConfigDict(extra="ignore")


class AutoscalerStatus(StatusModel):
    kind: str = Field(
        description="What scales the stage: OmniModelAutoscaler (the operator) or HorizontalPodAutoscaler."
    )
    name: str = Field(description="The Deployment it scales (operator) or the HPA's name.")
    current_replicas: int = Field(default=0, description="Replicas it last saw.")
    desired_replicas: int = Field(default=0, description="Replicas it last asked for.")
    metric: str | None = Field(default=None, description="The signal it follows (operator).")
    signal: float | None = Field(default=None, description="The signal's last value, summed over replicas.")
    target: float | None = Field(default=None, description="Target per replica.")
    reason: str | None = Field(default=None, description="Why the last decision is what it is.")
    last_scale_time: str | None = Field(default=None, description="When it last changed replicas (RFC 3339).")


class ComponentStatus(StatusModel):
    replicas: int = Field(default=0, description="Desired pods.")
    ready_replicas: int = Field(default=0, description="Pods ready.")
    updated_replicas: int = Field(default=0, description="Pods on the current template.")
    available_replicas: int = Field(default=0, description="Pods available.")
    reason: str = Field(
        default="",
        description="Ready, ScaledToZero (0 desired pods), CapacityLost (had its pods and lost some), "
        "or why it is not ready yet: InsufficientCapacity, ProgressDeadlineExceeded, Updating, PodsNotReady.",
    )
    message: str = Field(default="", description="Why it is not ready, when it is not.")


class StageStatus(ComponentStatus):
    name: str = Field(description="Stage name.")
    accelerator: str = Field(default="", description="Devices per replica, e.g. 2x nvidia H200.")
    service: str = Field(default="", description="In-cluster URL of the stage.")
    autoscaler: AutoscalerStatus | None = Field(default=None, description="The stage's autoscaler, if any.")


class WeightsStatus(StatusModel):
    state: Literal["Pending", "Fetching", "Complete", "Failed"] = Field(
        description="Pending (the fetch Job has not started), Fetching, Complete or Failed."
    )
    job: str = Field(description="The fetch Job.")
    revision: str | None = Field(default=None, description="The revision asked for (model.revision, or main).")
    sha: str | None = Field(default=None, description="The commit the revision resolved to.")
    files_done: int | None = Field(default=None, description="Files in the cache, of filesTotal.")
    files_total: int | None = Field(default=None, description="Files the stages need together.")
    bytes_done: int | None = Field(default=None, description="Bytes in the cache, of bytesTotal.")
    bytes_total: int | None = Field(default=None, description="Bytes the stages need together.")
    reason: str | None = Field(
        default=None,
        description="Why it failed: Unauthorized, NotFound, NoSpace, Network, RateLimited, HubError, Invalid "
        "or Failed (the fetch's own words, also WeightsReady's reason).",
    )
    message: str | None = Field(default=None, description="The fetch's last one-line outcome.")


class OmniModelStatus(StatusModel):
    observed_generation: int | None = Field(default=None, description="Last spec generation reconciled.")
    conditions: list[Condition] | None = Field(
        default=None,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
        description="Ready (summary), Progressing, Degraded.",
    )
    stages: list[StageStatus] | None = Field(
        default=None,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
        description="Per-stage rollout state.",
    )
    gateway: ComponentStatus | None = Field(default=None, description="Rollout state of the gateway.")
    ready_stages: str | None = Field(default=None, description="Ready stages over total, e.g. 2/3.")
    endpoint: str | None = Field(default=None, description="In-cluster URL of the OpenAI API.")
    served_modalities: list[Modality] | None = Field(
        default=None,
        description="Output modalities the model can serve now (a modality whose stages are scaled to 0 is left out).",
    )
    weights: WeightsStatus | None = Field(
        default=None,
        description="The fetch of an hf:// model into model.cache (absent when nothing is fetched).",
    )


class OmniModel(KubeModel):
    """The whole object; only ``spec`` and ``status`` are modelled, metadata stays Kubernetes'."""

    model_config = ConfigDict(extra="ignore")

    api_version: str = Field(description="omnimodel.io/v1alpha1")
    kind: str = Field(description="OmniModel")
    metadata: FreeForm = Field(description="Standard object metadata.")
    spec: OmniModelSpec = Field(description="Desired pipeline.")
    status: OmniModelStatus | None = Field(default=None, description="Observed state.")
