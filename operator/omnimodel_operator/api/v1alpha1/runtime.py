"""``spec.runtime`` and ``spec.gateway``, and the container settings they share with stages."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field

from omnimodel_operator.api.v1alpha1.base import (
    VLLM_OMNI_CONFIGS,
    VLLM_OMNI_VERSION,
    FreeForm,
    KubeModel,
    Quantity,
    cel,
)


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
    resources: Resources | None = Field(
        default=None,
        description="Gateway container CPU/memory requests and limits, defaulted as a stage's are from the "
        "operator's gateway requests (no per-device part).",
    )
    node_selector: dict[str, str] | None = Field(default=None, description="Gateway node selector.")
    tolerations: list[Toleration] | None = Field(default=None, max_length=32, description="Gateway tolerations.")
