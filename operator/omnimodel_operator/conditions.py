"""Status conditions, the Kubernetes way: type/status/reason/message/observedGeneration/
lastTransitionTime, where lastTransitionTime moves only when status flips."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Final

READY: Final = "Ready"
PROGRESSING: Final = "Progressing"
DEGRADED: Final = "Degraded"
WEIGHTS_READY: Final = "WeightsReady"  # only on OmniModels whose weights the operator fetches
CONDITION_TYPES: Final = (READY, PROGRESSING, DEGRADED, WEIGHTS_READY)

# Reasons (UpperCamelCase), most severe first; the summary Ready reason is the first that applies.
INVALID_SPEC: Final = "InvalidSpec"
# The API server refused what a Deployment controller creates (quota, LimitRange, an admission webhook):
# the Deployment's own ReplicaFailure reason, so the word is the one `kubectl describe` shows.
FAILED_CREATE: Final = "FailedCreate"
INSUFFICIENT_CAPACITY: Final = "InsufficientCapacity"
PROGRESS_DEADLINE_EXCEEDED: Final = "ProgressDeadlineExceeded"
UPDATING: Final = "Updating"
PODS_NOT_READY: Final = "PodsNotReady"
RECONCILE_ERROR: Final = "ReconcileError"
NAME_CONFLICT: Final = "NameConflict"
# Ready=False while a Secret the spec names (gateway.apiKeySecret, model.tokenSecret) is missing or lacks its key.
SECRET_NOT_FOUND: Final = "SecretNotFound"  # noqa: S105  (a condition reason, not a secret)
# Ready=False while the fetch Job has not put the weights in the cache, or after it gave up.
FETCHING_WEIGHTS: Final = "FetchingWeights"
WEIGHTS_FAILED: Final = "WeightsFailed"
ALL_READY: Final = "AllStagesReady"
STAGES_SCALED_TO_ZERO: Final = "StagesScaledToZero"
ROLLOUT_COMPLETE: Final = "RolloutComplete"
AS_EXPECTED: Final = "AsExpected"
REASON_PRIORITY: Final = (
    INVALID_SPEC,
    NAME_CONFLICT,
    RECONCILE_ERROR,
    FAILED_CREATE,
    INSUFFICIENT_CAPACITY,
    PROGRESS_DEADLINE_EXCEEDED,
    UPDATING,
    PODS_NOT_READY,
)

# Per-component reasons in status.stages[].reason (and status.gateway.reason), beside the ones above.
STAGE_READY: Final = "Ready"
SCALED_TO_ZERO: Final = "ScaledToZero"
CAPACITY_LOST: Final = "CapacityLost"


def find(conditions: Iterable[Mapping[str, Any]] | None, type_: str) -> Mapping[str, Any] | None:
    return next((c for c in conditions or () if c.get("type") == type_), None)


def set_condition(
    conditions: Iterable[Mapping[str, Any]] | None,
    type_: str,
    status: bool | None,
    reason: str,
    message: str,
    generation: int | None,
    now: str,
) -> list[dict[str, Any]]:
    """Return ``conditions`` with ``type_`` set; other conditions are kept as they are."""
    status_str = "Unknown" if status is None else ("True" if status else "False")
    previous = find(conditions, type_)
    transition = (
        previous["lastTransitionTime"]
        if previous is not None and previous.get("status") == status_str and previous.get("lastTransitionTime")
        else now
    )
    new = {
        "type": type_,
        "status": status_str,
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
        "lastTransitionTime": transition,
    }
    out = [dict(c) for c in conditions or () if c.get("type") != type_]
    out.append(new)
    order = {t: i for i, t in enumerate(CONDITION_TYPES)}
    return sorted(out, key=lambda c: order.get(c["type"], len(order)))
