"""Which replica pods vLLM-Omni's head routes to, read from the head and recorded on its Deployment.

vLLM-Omni 0.30 lists registered replicas nowhere; the operator's ``sitecustomize.py`` (podfiles/) adds
``GET /omnimodel/replicas`` to the head's API. The autoscaler's loop (every ``autoscale_interval``) reads
it for each vLLM-Omni OmniModel and writes what it found onto the head Deployment as one annotation
(its own field manager, so the operator's apply leaves it alone): per stage, the pod IPs the head has
registered with a current heartbeat, and the running pods it had and no longer has (detached: 0.30
never takes those back). The change is a watch event, so status follows within a pass; ``state.py``
counts a replica pod as ready only when it is registered.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import httpx

from omnimodel_operator import constants as C
from omnimodel_operator.kube import KubeClient
from omnimodel_operator.vllm_omni.plan import API_PORT, VllmPlan

Manifest = dict[str, Any]

ANNOTATION: Final = "omnimodel.io/registered-replicas"
FIELD_MANAGER: Final = "omnimodel-membership"
PATH: Final = "/omnimodel/replicas"


@dataclass(frozen=True)
class StageMembers:
    """Pod IPs of one stage's replicas: registered (UP), and lost (registered once, still running, not now)."""

    registered: tuple[str, ...] = ()
    lost: tuple[str, ...] = ()


@dataclass(frozen=True)
class Membership:
    stages: dict[str, StageMembers] = field(default_factory=dict)

    def to_annotation(self) -> str:
        return json.dumps(
            {k: {"registered": list(v.registered), "lost": list(v.lost)} for k, v in sorted(self.stages.items())},
            sort_keys=True,
            separators=(",", ":"),
        )

    @classmethod
    def from_annotation(cls, text: str | None) -> Membership | None:
        if not text:
            return None
        try:
            data = json.loads(text)
            return cls(
                {
                    str(k): StageMembers(tuple(v.get("registered", ())), tuple(v.get("lost", ())))
                    for k, v in data.items()
                }
            )
        except (ValueError, AttributeError):
            return None


def _running_ip(pod: Mapping[str, Any]) -> str | None:
    status = pod.get("status") or {}
    if pod["metadata"].get("deletionTimestamp") or status.get("phase") != "Running":
        return None
    ip = status.get("podIP")
    return str(ip) if ip else None


def membership_of(
    plan: VllmPlan, answer: Mapping[str, Any], replica_pods: Sequence[Manifest], previous: Membership | None
) -> Membership:
    """The head's answer, by stage name, with what it no longer has of the pods still running."""
    names = {str(sp.stage.id): sp.name for sp in plan.stages}
    running: dict[str, set[str]] = {}
    for pod in replica_pods:
        ip = _running_ip(pod)
        stage = (pod["metadata"].get("labels") or {}).get(C.LABEL_STAGE)
        if ip and stage:
            running.setdefault(stage, set()).add(ip)
    stages: dict[str, StageMembers] = {}
    for stage_id, name in names.items():
        rows = (answer.get("stages") or {}).get(stage_id) or []
        registered = sorted({str(r["host"]) for r in rows if r.get("host") and r.get("up", True)})
        listed = {str(r["host"]) for r in rows if r.get("host")}
        before = previous.stages.get(name, StageMembers()) if previous else StageMembers()
        had = set(before.registered) | set(before.lost)
        lost = sorted((had & running.get(name, set())) - listed)
        stages[name] = StageMembers(tuple(registered), tuple(lost))
    return Membership(stages)


async def publish(
    client: KubeClient,
    http: httpx.AsyncClient,
    plan: VllmPlan,
    head_deployment: Manifest | None,
    head_pods: Sequence[Manifest],
    replica_pods: Sequence[Manifest],
) -> Membership | None:
    """Read the running head's membership and record it if it changed; None when there is no head to ask."""
    ips = [ip for p in head_pods if (ip := _running_ip(p))]
    if head_deployment is None or not ips:
        return None
    try:
        response = await http.get(f"http://{ips[-1]}:{API_PORT}{PATH}")
        response.raise_for_status()
        answer = response.json()
    except (httpx.HTTPError, ValueError):
        return None  # the head is starting or gone: its pods' own state says so
    meta = head_deployment["metadata"]
    previous = Membership.from_annotation((meta.get("annotations") or {}).get(ANNOTATION))
    now = membership_of(plan, answer, replica_pods, previous)
    if previous != now:
        await client.apply(
            {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": {
                    "name": meta["name"],
                    "namespace": meta["namespace"],
                    "annotations": {ANNOTATION: now.to_annotation()},
                },
            },
            FIELD_MANAGER,
        )
    return now
