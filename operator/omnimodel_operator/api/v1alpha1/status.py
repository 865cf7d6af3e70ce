"""``status``: what the operator writes (conditions, per-stage rollout, weights)."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from omnimodel_operator.api.v1alpha1.base import KubeModel
from omnimodel_runtime.pipeline import Modality


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
    stage_bytes: dict[str, int] | None = Field(
        default=None,
        description="Bytes of each stage's own files (stages may share files), as the fetch planned them; kept "
        "once known for this Job. A stage without accelerator devices requests at least this much memory plus "
        "1Gi (its weights sit in host memory), unless its resources set memory.",
    )
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
