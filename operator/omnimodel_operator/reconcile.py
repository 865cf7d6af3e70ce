"""The one level-based reconcile: spec → plan → apply children → prune → status from children.

Idempotent: the same OmniModel and the same children produce no API writes. Called for create,
update and resume, by the status timer and on child events; the kopf handlers only wrap it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from omnimodel_operator import conditions as cond
from omnimodel_operator import constants as C
from omnimodel_operator import naming
from omnimodel_operator.builders import CHILD_KINDS, Manifest, render
from omnimodel_operator.kube import KubeClient
from omnimodel_operator.resolve import InvalidSpec, Plan, resolve
from omnimodel_operator.settings import OperatorSettings


def utc_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class ComponentState:
    """Rollout state of one Deployment (a stage or the gateway)."""

    name: str
    desired: int = 0
    ready: int = 0
    updated: int = 0
    available: int = 0
    # None when rolled out and available; else one of conditions.REASON_PRIORITY.
    reason: str | None = cond.UPDATING
    message: str = ""

    @property
    def is_ready(self) -> bool:
        return self.reason is None


@dataclass
class Outcome:
    applied: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    status: dict[str, Any] = field(default_factory=dict)
    invalid: InvalidSpec | None = None


def _ref(manifest: Mapping[str, Any]) -> str:
    return f"{manifest['kind']} {manifest['metadata'].get('namespace', '')}/{manifest['metadata']['name']}"


# Values the API server drops on the way in (Go `omitempty`), so a missing key matches them.
_EMPTY: tuple[Any, ...] = ("", None, False, 0)


def is_subset(want: Any, have: Any) -> bool:
    """Every field we set is present with the same value (extra fields — defaults — are fine)."""
    if isinstance(want, Mapping):
        return isinstance(have, Mapping) and all(
            is_subset(v, have[k]) if k in have else _is_empty(v) for k, v in want.items()
        )
    if isinstance(want, list):
        return isinstance(have, list) and len(want) == len(have) and all(map(is_subset, want, have))
    return bool(want == have)


def _is_empty(value: Any) -> bool:
    if isinstance(value, (Mapping, list)):
        return not value
    return any(value is e or (type(value) is type(e) and value == e) for e in _EMPTY)


def needs_apply(desired: Manifest, live: Manifest | None) -> bool:
    if live is None:
        return True
    ann = C.ANNOTATION_APPLIED_HASH
    if (live["metadata"].get("annotations") or {}).get(ann) != desired["metadata"]["annotations"][ann]:
        return True
    return not is_subset({k: v for k, v in desired.items() if k != "status"}, live)


def _owned_by(obj: Manifest, uid: str | None) -> bool:
    return any(r.get("uid") == uid and r.get("controller") for r in obj["metadata"].get("ownerReferences") or [])


def _unschedulable(pods: Iterable[Manifest]) -> str | None:
    for pod in pods:
        for c in (pod.get("status") or {}).get("conditions") or []:
            if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable":
                return str(c.get("message") or "pod cannot be scheduled")
    return None


def _waiting_reason(pods: Iterable[Manifest]) -> str | None:
    """A container stuck waiting (ImagePullBackOff, CrashLoopBackOff) explains a not-ready stage best."""
    for pod in pods:
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            waiting = (cs.get("state") or {}).get("waiting")
            if waiting and waiting.get("reason") not in (None, "ContainerCreating", "PodInitializing"):
                return f"{waiting['reason']}: {waiting.get('message', '')}".rstrip(": ")
    return None


def component_state(name: str, deployment: Manifest | None, pods: Sequence[Manifest]) -> ComponentState:
    if deployment is None:
        return ComponentState(name, reason=cond.UPDATING, message=f"{name}: Deployment not created yet")
    spec = deployment.get("spec") or {}
    status = deployment.get("status") or {}
    desired = int(spec.get("replicas", 1))
    ready = int(status.get("readyReplicas", 0))
    updated = int(status.get("updatedReplicas", 0))
    available = int(status.get("availableReplicas", 0))
    total = int(status.get("replicas", 0))
    generation = deployment["metadata"].get("generation", 0)
    observed = int(status.get("observedGeneration", 0))
    base = ComponentState(name, desired, ready, updated, available)
    if observed >= generation and updated == desired and available == desired and total == desired:
        return ComponentState(name, desired, ready, updated, available, reason=None)
    unschedulable = _unschedulable(pods)
    if unschedulable:
        return ComponentState(
            name, desired, ready, updated, available, cond.INSUFFICIENT_CAPACITY,
            f"{name}: pods cannot be scheduled: {unschedulable}",
        )  # fmt: skip
    if observed < generation or updated < desired or total > desired:
        return ComponentState(
            name, desired, ready, updated, available, cond.UPDATING,
            f"{name}: rolling out, {updated}/{desired} updated, {available}/{desired} available",
        )  # fmt: skip
    waiting = _waiting_reason(pods)
    detail = f" ({waiting})" if waiting else ""
    return ComponentState(
        base.name, desired, ready, updated, available, cond.PODS_NOT_READY,
        f"{name}: {available}/{desired} pods available{detail}",
    )  # fmt: skip


def _accelerator_text(plan: Plan, stage: str) -> str:
    acc = plan.pipeline.stage(stage).accelerator
    if acc.count == 0:
        return "cpu"
    return f"{acc.count}x {acc.vendor.value}" + (f" {acc.product}" if acc.product else "")


def compute_status(
    plan: Plan,
    stage_states: Sequence[ComponentState],
    gateway: ComponentState,
    old: Mapping[str, Any],
    generation: int | None,
    now: str,
) -> dict[str, Any]:
    """Roll child state up into conditions; pure, so every transition is unit-testable."""
    components = [*stage_states, gateway]
    not_ready = [c for c in components if not c.is_ready]
    conditions = old.get("conditions")
    if not not_ready:
        conditions = cond.set_condition(
            conditions, cond.READY, True, cond.ALL_READY,
            f"{len(stage_states)} stage(s) and the gateway are available", generation, now,
        )  # fmt: skip
    else:
        worst = min(not_ready, key=lambda c: cond.REASON_PRIORITY.index(c.reason or cond.UPDATING))
        conditions = cond.set_condition(
            conditions, cond.READY, False, worst.reason or cond.UPDATING,
            "; ".join(c.message for c in not_ready), generation, now,
        )  # fmt: skip
    updating = [c for c in components if c.reason == cond.UPDATING]
    conditions = cond.set_condition(
        conditions, cond.PROGRESSING, bool(updating),
        cond.UPDATING if updating else cond.ROLLOUT_COMPLETE,
        "; ".join(c.message for c in updating) or "every stage runs the current spec", generation, now,
    )  # fmt: skip
    degraded = [c for c in components if c.reason in (cond.INSUFFICIENT_CAPACITY, cond.PODS_NOT_READY)]
    conditions = cond.set_condition(
        conditions, cond.DEGRADED, bool(degraded),
        degraded[0].reason or "" if degraded else cond.AS_EXPECTED,
        "; ".join(c.message for c in degraded), generation, now,
    )  # fmt: skip
    stages = [
        {
            "name": s.name,
            "replicas": s.desired,
            "readyReplicas": s.ready,
            "updatedReplicas": s.updated,
            "availableReplicas": s.available,
            "accelerator": _accelerator_text(plan, s.name),
            "service": f"http://{naming.stage_name(plan.name, s.name)}.{plan.namespace}.svc:{C.STAGE_PORT}",
            "message": "" if s.is_ready else s.message,
        }
        for s in stage_states
    ]
    ready_count = sum(1 for s in stage_states if s.is_ready)
    return {
        "observedGeneration": generation,
        "conditions": conditions,
        "stages": stages,
        "readyStages": f"{ready_count}/{len(stage_states)}",
        "endpoint": plan.endpoint,
    }


def invalid_status(err: InvalidSpec, old: Mapping[str, Any], generation: int | None, now: str) -> dict[str, Any]:
    """Ready=False/InvalidSpec; children and the last good stage status are left as they were."""
    conditions = cond.set_condition(
        old.get("conditions"), cond.READY, False, cond.INVALID_SPEC, str(err), generation, now
    )
    conditions = cond.set_condition(
        conditions, cond.PROGRESSING, False, cond.INVALID_SPEC, "nothing applied: the spec is invalid",
        generation, now,
    )  # fmt: skip
    return {**old, "observedGeneration": generation, "conditions": conditions}


def _event(body: Mapping[str, Any], type_: str, reason: str, message: str, now: str) -> Manifest:
    meta = body["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "Event",
        # generateName: the server picks a unique suffix, so two events in one second never collide.
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {
            "apiVersion": C.API_VERSION,
            "kind": C.KIND,
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta.get("uid"),
        },
        "type": type_,
        "reason": reason,
        "message": message[:1024],
        "source": {"component": C.MANAGED_BY},
        "reportingComponent": C.MANAGED_BY,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }


def _transition_events(
    body: Mapping[str, Any], old: Mapping[str, Any], new: Mapping[str, Any], now: str
) -> list[Manifest]:
    """Events only when Ready's status or reason changes, never on every pass."""
    before = cond.find(old.get("conditions"), cond.READY)
    after = cond.find(new.get("conditions"), cond.READY)
    if after is None:
        return []
    if before is not None and (before["status"], before["reason"]) == (after["status"], after["reason"]):
        return []
    if after["status"] == "True":
        return [_event(body, "Normal", "Ready", after["message"], now)]
    if after["reason"] == cond.UPDATING:
        return [_event(body, "Normal", "RollingOut", after["message"], now)]
    return [_event(body, "Warning", after["reason"], after["message"], now)]


async def _write_status(
    client: KubeClient, body: Mapping[str, Any], old: Mapping[str, Any], new: dict[str, Any], now: str
) -> None:
    if new == old:
        return
    meta = body["metadata"]
    patch = {**new, **{k: None for k in old if k not in new}}
    await client.patch_status(C.API_VERSION, C.KIND, meta["namespace"], meta["name"], patch)
    for event in _transition_events(body, old, new, now):
        await client.create(event)


async def _apply_children(
    client: KubeClient, plan: Plan, settings: OperatorSettings, uid: str | None, outcome: Outcome
) -> dict[tuple[str, str], Manifest]:
    """Server-side apply what differs, then delete owned children that are no longer desired."""
    desired = render(plan, settings)
    namespace = plan.namespace
    selector = naming.owned_selector(plan.name)
    # Independent reads and writes go out concurrently: a reconcile is ~10 round trips, and with
    # hundreds of OmniModels latency, not API-server CPU, bounds throughput.
    listed = await asyncio.gather(
        *(client.list(api_version, kind, namespace, selector) for api_version, kind in CHILD_KINDS)
    )
    live = {(o["kind"], o["metadata"]["name"]): o for objs in listed for o in objs if _owned_by(o, uid)}

    current: dict[tuple[str, str], Manifest] = {}

    async def apply(manifest: Manifest) -> None:
        key = (manifest["kind"], manifest["metadata"]["name"])
        if needs_apply(manifest, live.get(key)):
            current[key] = await client.apply(manifest, C.FIELD_MANAGER)
            outcome.applied.append(_ref(manifest))
        else:
            current[key] = live[key]

    # The ConfigMap first: pods that mount it should never start before it exists.
    await apply(desired[0])
    await asyncio.gather(*(apply(m) for m in desired[1:]))
    stale = [obj for key, obj in live.items() if key not in current]
    await asyncio.gather(*(client.delete(o["apiVersion"], o["kind"], namespace, o["metadata"]["name"]) for o in stale))
    outcome.deleted.extend(sorted(_ref(o) for o in stale))
    outcome.applied.sort()
    return current


async def reconcile(
    client: KubeClient,
    body: Mapping[str, Any],
    settings: OperatorSettings,
    now: Callable[[], str] = utc_now,
    *,
    status_only: bool = False,
) -> Outcome:
    """Bring one OmniModel's children and status in line with its spec.

    ``status_only`` re-reads Deployments and Pods and rewrites status without touching children: what a
    child event needs, at two list calls instead of seven plus applies.
    """
    meta = body["metadata"]
    name, namespace, uid = meta["name"], meta["namespace"], meta.get("uid")
    generation = meta.get("generation")
    old_status: Mapping[str, Any] = body.get("status") or {}
    outcome = Outcome()
    try:
        plan = resolve(name, namespace, body.get("spec") or {}, settings, uid=uid)
    except InvalidSpec as err:
        # Nothing is applied and nothing deleted: the last good children keep serving.
        outcome.invalid = err
        outcome.status = invalid_status(err, old_status, generation, now())
        await _write_status(client, body, old_status, outcome.status, now())
        return outcome

    selector = naming.owned_selector(name)
    if status_only:
        deployments = await client.list("apps/v1", "Deployment", namespace, selector)
        current = {("Deployment", d["metadata"]["name"]): d for d in deployments if _owned_by(d, uid)}
    else:
        current = await _apply_children(client, plan, settings, uid, outcome)

    pods = await client.list("v1", "Pod", namespace, selector)

    def state(component: str, deploy_name: str, pod_selector: Mapping[str, str]) -> ComponentState:
        mine = [
            p for p in pods if all((p["metadata"].get("labels") or {}).get(k) == v for k, v in pod_selector.items())
        ]
        return component_state(component, current.get(("Deployment", deploy_name)), mine)

    stage_states = [
        state(sp.stage.name, naming.stage_name(name, sp.stage.name), naming.stage_selector(name, sp.stage.name))
        for sp in plan.stages
    ]
    gateway = state("gateway", naming.gateway_name(name), naming.gateway_selector(name))
    outcome.status = compute_status(plan, stage_states, gateway, old_status, generation, now())
    await _write_status(client, body, old_status, outcome.status, now())
    return outcome
