"""Keeping vLLM-Omni 0.30.0's replicas with their head across head restarts (its bug, our controller).

Measured on the test bed (``docs/vllm-omni.md``): after a head restart the old replicas neither
re-register nor exit, so the new head waits for them in vain. The operator records on the replica
Deployments (metadata annotation) the head process their pods registered with; when the running head is
another process (restarted, rescheduled), their restart epoch (a pod-template annotation) goes up, so every
replica restarts and registers with the new head. (Their liveness probe, which asks the head whether it
has this pod, does the same where the kubelet runs probes; this rule also covers clusters where it has
not failed yet.)

A replica that goes away (scaled down, evicted, killed) no longer restarts the head: a replica that
stops sends DOWN and the head detaches it within a second, and one that dies is detached after its
heartbeat timeout; the other replicas keep serving either way (``docs/vllm-omni.md``, "Scaling without
an outage"). The head's record of the replica processes it has had (``REPLICA_PODS``) is kept for
``kubectl describe``, not acted on. A head's first process adopts whatever replicas start with it;
nothing restarts at creation.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from omnimodel_operator import constants as C

Manifest = dict[str, Any]

EPOCH: Final = "omnimodel.io/restart-epoch"
REGISTERED_WITH: Final = "omnimodel.io/registered-with"
REPLICA_PODS: Final = "omnimodel.io/replica-pods"
PENDING: Final = "pending"


@dataclass(frozen=True)
class RestartMarks:
    """Annotations the builders put on the head and replica Deployments (metadata and pod template)."""

    head_template: dict[str, str] = field(default_factory=lambda: {EPOCH: "0"})
    head_metadata: dict[str, str] = field(default_factory=lambda: {REPLICA_PODS: ""})
    replica_template: dict[str, str] = field(default_factory=lambda: {EPOCH: "0"})
    replica_metadata: dict[str, str] = field(default_factory=lambda: {REGISTERED_WITH: PENDING})


def _annotation(obj: Mapping[str, Any] | None, key: str, *, template: bool) -> str | None:
    if obj is None:
        return None
    meta = obj["spec"]["template"]["metadata"] if template else obj["metadata"]
    value = (meta.get("annotations") or {}).get(key)
    return str(value) if value is not None else None


def _running(pod: Mapping[str, Any]) -> bool:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return bool(statuses) and all("running" in (s.get("state") or {}) for s in statuses)


def incarnation(pod: Mapping[str, Any]) -> str:
    """One process of a pod: its uid and how often its containers restarted."""
    restarts = sum(int(s.get("restartCount", 0)) for s in (pod.get("status") or {}).get("containerStatuses") or [])
    return f"{pod['metadata']['uid']}:{restarts}"


def _epoch(value: str | None) -> int:
    try:
        return int(value or 0)
    except ValueError:
        return 0


def restart_marks(
    head: Manifest | None,
    replicas: Sequence[Manifest | None],
    head_pods: Iterable[Manifest],
    replica_pods: Iterable[Manifest],
) -> RestartMarks:
    """The marks for this pass, from the live head Deployment, replica Deployments and their pods."""
    live_replicas = [r for r in replicas if r is not None]
    replica_epoch = max((_epoch(_annotation(r, EPOCH, template=True)) for r in live_replicas), default=0)
    recorded = next((v for r in live_replicas if (v := _annotation(r, REGISTERED_WITH, template=False))), PENDING)
    running_heads = sorted(
        (p for p in head_pods if _running(p) and not p["metadata"].get("deletionTimestamp")),
        key=lambda p: str(p["metadata"].get("creationTimestamp", "")),
    )
    if running_heads:
        now = incarnation(running_heads[-1])
        if recorded not in (PENDING, now):
            replica_epoch += 1
        recorded = now

    head_epoch = _epoch(_annotation(head, EPOCH, template=True))
    current = {
        f"{replica_epoch}/{incarnation(p)}"
        for p in replica_pods
        if _running(p) and (p["metadata"].get("annotations") or {}).get(EPOCH) == str(replica_epoch)
    }
    seen = current
    return RestartMarks(
        head_template={EPOCH: str(head_epoch)},
        head_metadata={REPLICA_PODS: ",".join(sorted(seen))},
        replica_template={EPOCH: str(replica_epoch)},
        replica_metadata={REGISTERED_WITH: recorded},
    )


def is_head_pod(pod: Mapping[str, Any]) -> bool:
    return (pod["metadata"].get("labels") or {}).get(C.LABEL_COMPONENT) == "head"


def is_replica_pod(pod: Mapping[str, Any]) -> bool:
    return (pod["metadata"].get("labels") or {}).get(C.LABEL_COMPONENT) == C.COMPONENT_STAGE
