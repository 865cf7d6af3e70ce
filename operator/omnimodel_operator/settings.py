"""Operator settings: one pydantic-settings object, read from ``OMNIMODEL_*`` environment variables.

The Helm chart sets these on the operator Deployment (e.g. the runtime image per vendor).
"""

from __future__ import annotations

from typing import Annotated, Any, Final

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from omnimodel_operator import __version__
from omnimodel_operator import constants as C
from omnimodel_operator.accelerators import ACCELERATORS
from omnimodel_operator.quantity import parse_quantity
from omnimodel_runtime.pipeline import Vendor

# The runtime image this release publishes per vendor (docker/runtime.<variant>.Dockerfile). Only vendors
# with a Dockerfile are here: a default naming a tag that is never pushed would leave the vendor's pods in
# ImagePullBackOff, so their stages are refused until runtime_images or spec.runtime.image names one.
DEFAULT_RUNTIME_IMAGES: Final = {
    vendor.value: f"{C.DEFAULT_RUNTIME_REPOSITORY}:{__version__}-{spec.image_variant}"
    for vendor, spec in ACCELERATORS.items()
    if spec.has_runtime_image
}


# Upstream vLLM-Omni images for the version the catalogue was generated from (override per vendor with
# OMNIMODEL_VLLM_OMNI_IMAGES or spec.runtime.image; not pulled or verified from this repository's CI).
DEFAULT_VLLM_OMNI_IMAGE: Final = "vllm/vllm-omni:v0.30.0"
DEFAULT_VLLM_OMNI_IMAGES: Final = {"nvidia": DEFAULT_VLLM_OMNI_IMAGE, "amd": "vllm/vllm-omni-rocm:v0.30.0"}


class OperatorSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="OMNIMODEL_", extra="ignore", frozen=True)

    runtime_images: dict[str, str] = Field(
        default_factory=lambda: dict(DEFAULT_RUNTIME_IMAGES),
        description="Runtime image per accelerator vendor (JSON object), used when a CR sets none. Vendors "
        "left out get this release's image where one is published (nvidia, amd, cpu); a stage on any other "
        "vendor (intel, ascend) is refused until this or spec.runtime.image names an image.",
    )
    image_pull_policy: str = Field(default="IfNotPresent")
    resync_interval: float = Field(
        default=600.0,
        gt=0,
        description="Seconds between safety-net passes over every OmniModel. Changes to an OmniModel "
        "or anything it owns are reconciled as their watch events arrive; this pass only catches what "
        "a lost event would miss, and costs no API request when nothing drifted.",
    )
    event_coalesce_seconds: float = Field(
        default=0.2,
        ge=0,
        description="How long a child or pod event waits for more events of the same OmniModel before "
        "its pass runs (a rollout sends dozens).",
    )
    workers: int = Field(default=4, ge=1, le=64, description="OmniModels reconciled concurrently.")
    retry_base_delay: float = Field(
        default=0.5, gt=0, description="First retry delay after a failed pass; doubles per failure."
    )
    retry_max_delay: float = Field(default=300.0, gt=0, description="Longest retry delay after failed passes.")
    stage_requests: dict[str, str] = Field(
        default_factory=lambda: {"cpu": "500m", "memory": "2Gi"},
        description="Requests (JSON object) of a stage container for what its spec does not request: the "
        "whole of a CPU stage's, and the process's own share of an accelerator stage's, which adds "
        "device_requests per device.",
    )
    device_requests: dict[str, str] = Field(
        default_factory=lambda: {"cpu": "2", "memory": "16Gi"},
        description="Requests (JSON object) a stage container adds per accelerator device of a replica, "
        "for the host threads that feed it and the host memory weights pass through while loading.",
    )
    gateway_requests: dict[str, str] = Field(
        default_factory=lambda: {"cpu": "250m", "memory": "512Mi"},
        description="Requests (JSON object) of a gateway container (and vLLM-Omni's Mooncake master) for "
        "what its spec does not request.",
    )
    fetch_requests: dict[str, str] = Field(
        default_factory=lambda: {"cpu": "500m", "memory": "1Gi"},
        description="Requests (JSON object) of the weights fetch Job's container.",
    )
    limit_ratios: dict[str, Annotated[float, Field(ge=0)]] = Field(
        default_factory=lambda: {"cpu": 4.0, "memory": 1.0},
        description="Limit of each resource (JSON object) as a multiple of the container's request, for "
        "every container whose spec sets no limit of that resource; 0 sets none. Memory 1: a container "
        "past its memory request is the first evicted and can take the node's memory from others, so it "
        "is OOMKilled at its request instead. CPU 4: CPU is throttled, not killed, so a limit above the "
        "request lets a stage burst into idle CPUs (loading, a prefill), and the runtime sizes its thread "
        "pools from the limit (a limit equal to a 500m request would give one thread).",
    )

    @field_validator("stage_requests", "device_requests", "gateway_requests", "fetch_requests")
    @classmethod
    def _quantities(cls, value: dict[str, str]) -> dict[str, str]:
        for resource, amount in value.items():
            parse_quantity(amount)  # a ValueError names the quantity; pydantic names the setting
            if not resource:
                raise ValueError("a resource name is empty")
        return value

    scrape_from: dict[str, Any] | None = Field(
        default=None,
        description="A NetworkPolicy peer (JSON, e.g. a namespaceSelector for the monitoring namespace) "
        "allowed to reach stage and gateway pods' /metrics; unset = only the gateway reaches stages.",
    )
    namespaces: list[str] = Field(
        default_factory=list, description="Namespaces to watch (JSON list); empty = cluster-wide."
    )
    network_policy: bool = Field(
        default=True,
        description="Render NetworkPolicies limiting stage ingress to the gateway and upstream stages.",
    )
    health_port: int = Field(default=8080, description="kopf liveness endpoint port.")
    api_startup_timeout: float = Field(
        default=30.0,
        gt=0,
        description="Seconds `omnimodel-operator run` keeps trying, before kopf starts, to list OmniModels "
        "while the API server is unreachable, answers 5xx/429, or serves no OmniModels yet; then it exits "
        "non-zero. A missing cluster config and refused credentials (401/403) exit at once.",
    )
    metrics_port: int = Field(
        default=8081,
        ge=0,
        le=65535,
        description="Port of the Prometheus endpoint `/metrics` (all interfaces); 0 serves no metrics.",
    )

    autoscale_interval: float = Field(
        default=10.0, gt=0, description="Seconds between the autoscaler's decisions (stages on provider operator)."
    )
    autoscale_scrape_timeout: float = Field(
        default=2.0, gt=0, description="Seconds the autoscaler waits for a pod's /metrics."
    )
    weights_progress_interval: float = Field(
        default=10.0,
        gt=0,
        description="Seconds between reads of a running fetch pod's /progress for status.weights.",
    )
    vllm_omni_images: dict[str, str] = Field(
        default_factory=lambda: dict(DEFAULT_VLLM_OMNI_IMAGES),
        description="vLLM-Omni image per accelerator vendor (JSON object), for runtime.kind vllm-omni when a "
        "CR sets no image.",
    )
    vllm_omni_env: dict[str, str] = Field(
        default_factory=dict,
        description="Extra environment (JSON object) for every vLLM-Omni container, e.g. a platform plugin's "
        "switch; a stage's own env wins.",
    )

    def vllm_omni_image(self, vendor: Vendor) -> str:
        return self.vllm_omni_images.get(
            vendor.value, DEFAULT_VLLM_OMNI_IMAGES.get(vendor.value, DEFAULT_VLLM_OMNI_IMAGE)
        )

    def runtime_image(self, vendor: Vendor) -> str | None:
        """The runtime image for ``vendor``'s stages; None when neither runtime_images nor this release
        names one (a vendor without a published image)."""
        return self.runtime_images.get(vendor.value, DEFAULT_RUNTIME_IMAGES.get(vendor.value))

    @property
    def cpu_runtime_image(self) -> str:
        """The image of the gateway and the weights fetcher: CPU always has a published one."""
        return self.runtime_images.get(Vendor.CPU.value, DEFAULT_RUNTIME_IMAGES[Vendor.CPU.value])
