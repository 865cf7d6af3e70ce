"""Operator settings: one pydantic-settings object, read from ``OMNIMODEL_*`` environment variables.

The Helm chart sets these on the operator Deployment (e.g. the runtime image per vendor).
"""

from __future__ import annotations

from typing import Final

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from omnimodel_operator import __version__
from omnimodel_operator import constants as C
from omnimodel_operator.accelerators import ACCELERATORS
from omnimodel_runtime.pipeline import Vendor

DEFAULT_RUNTIME_IMAGES: Final = {
    vendor.value: f"{C.DEFAULT_RUNTIME_REPOSITORY}:{__version__}-{spec.image_variant}"
    for vendor, spec in ACCELERATORS.items()
}


class OperatorSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="OMNIMODEL_", extra="ignore", frozen=True)

    runtime_images: dict[str, str] = Field(
        default_factory=lambda: dict(DEFAULT_RUNTIME_IMAGES),
        description="Runtime image per accelerator vendor (JSON object), used when a CR sets none.",
    )
    image_pull_policy: str = Field(default="IfNotPresent")
    status_interval: float = Field(
        default=30.0,
        gt=0,
        description="Seconds between full level-based passes over each OmniModel (drift repair and "
        "status); child Deployment events refresh status in between.",
    )
    namespaces: list[str] = Field(
        default_factory=list, description="Namespaces to watch (JSON list); empty = cluster-wide."
    )
    network_policy: bool = Field(
        default=True,
        description="Render NetworkPolicies limiting stage ingress to the gateway and upstream stages.",
    )
    health_port: int = Field(default=8080, description="kopf liveness endpoint port.")
    metrics_port: int = Field(
        default=8081,
        ge=0,
        le=65535,
        description="Port of the Prometheus endpoint `/metrics` (all interfaces); 0 serves no metrics.",
    )

    def runtime_image(self, vendor: Vendor) -> str:
        return self.runtime_images.get(vendor.value, DEFAULT_RUNTIME_IMAGES[vendor.value])
