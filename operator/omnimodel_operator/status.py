"""Status from live objects: per-component rollout state, then the OmniModel's conditions.

Pure functions over plain manifests, so every transition (rollout, stuck rollout, lost capacity, scale
to zero, apply failure, name conflict) is unit-testable. The result is the schema model
(:class:`~omnimodel_operator.api.v1alpha1.OmniModelStatus`), so what the operator writes is checked
against what the CRD documents.

Condition semantics (the choices DESIGN left open):

- **Ready** is True when every stage and the gateway run the current spec with all desired pods
  available, nothing failed to apply, and at least one output modality can be served. A stage the
  user scaled to 0 does not make the model unready while another modality still works (text with the
  talker at 0): reason ``StagesScaledToZero`` names what is unavailable; when nothing can be served
  (gateway or every path at 0) Ready is False with ``ScaledToZero``. A stage the autoscaler took to
  zero (``minReplicas: 0``) still serves, on demand: the gateway holds its requests while it wakes, so
  it leaves Ready alone (the message names it as idle).
- **Progressing** is True while a rollout or scale-up is under way *or stuck*, with the reason:
  ``FailedCreate`` (the API server refused the stage's pods or ReplicaSet: quota, LimitRange, an
  admission webhook), ``InsufficientCapacity`` (pods cannot be scheduled), ``ProgressDeadlineExceeded``
  (the Deployment controller gave up waiting), ``PodsNotReady`` (pods run but are not ready; a container
  the kubelet cannot start or keep running, ImagePullBackOff, CrashLoopBackOff, OOMKilled, is named with
  the kubelet's words even mid-rollout), ``Updating`` (a rollout with nothing stuck). Ready, when False,
  carries the same reason; every message names the stage and quotes Kubernetes verbatim.
- **WeightsReady** (only when the operator fetches an ``hf://`` model into ``model.cache``) follows the
  fetch Job (:mod:`omnimodel_operator.weights`); until it is True, Ready is False with
  ``FetchingWeights`` (Progressing True, same reason) or, once the Job gave up, ``WeightsFailed``.
- **Degraded** is True only for lost capacity: a component whose last rollout completed and that has
  lost pods since, without a spec change (a crashed or evicted pod that does not come back). It stays
  True until the component is whole again, and is never set while a rollout or a scale-up waits for
  new pods.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from omnimodel_operator import conditions as cond
from omnimodel_operator.api.v1alpha1 import AutoscalerStatus, ComponentStatus, OmniModelStatus, StageStatus
from omnimodel_operator.weights import Weights
from omnimodel_runtime.pipeline import AcceleratorRequest

Manifest = dict[str, Any]


@dataclass(frozen=True)
class ComponentState:
    """Rollout state of one Deployment (a stage or the gateway)."""

    name: str
    desired: int = 0
    ready: int = 0
    updated: int = 0
    available: int = 0
    # None when rolled out and available; else why not (one of conditions.REASON_PRIORITY).
    reason: str | None = cond.UPDATING
    message: str = ""
    # Lost capacity (see the module docstring) rather than a rollout still under way.
    degraded: bool = False

    @property
    def is_ready(self) -> bool:
        return self.reason is None


def _unschedulable(pods: Iterable[Manifest]) -> str | None:
    for pod in pods:
        for c in (pod.get("status") or {}).get("conditions") or []:
            if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable":
                return str(c.get("message") or "pod cannot be scheduled")
    return None


# Waiting reasons of a container that is still starting, not stuck.
_STARTING = (None, "ContainerCreating", "PodInitializing")


# A line that starts a message at column 0: "ValueError: ...", "omnimodel stage: ...", a log record.
_HEADED = re.compile(r"^\S.*?: ")


def _last_words(text: str, limit: int = 300) -> str:
    """The end of a termination message on one line, from its last line that starts a message (a
    traceback's exception, an error printed with its details below it), cropped to ``limit``."""
    lines = [line for line in text.splitlines() if line.strip()]
    start = next((i for i in reversed(range(len(lines))) if _HEADED.match(lines[i])), max(0, len(lines) - 1))
    said = " ".join(" ".join(lines[start:]).split())
    return said if len(said) <= limit else said[: limit - 1] + "…"


def _container_trouble(pods: Iterable[Manifest]) -> str | None:
    """What the kubelet says keeps a container from running, in its words: a waiting reason other than
    starting up (ImagePullBackOff, ErrImagePull, CrashLoopBackOff, CreateContainerConfigError) with its
    message, which names the image or the failed container, and how the container last ended
    (``OOMKilled``, exit code 137) with the end of its termination message (the runtime's containers fall
    back to their log's tail: a crash's exception). Containers that are ready are not trouble, whatever
    they once were, and neither are pods on their way out (an old pod stopping in a rollout, an evicted
    one already replaced)."""
    for pod in pods:
        status = pod.get("status") or {}
        if (pod.get("metadata") or {}).get("deletionTimestamp") or status.get("phase") in ("Succeeded", "Failed"):
            continue
        for cs in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
            if cs.get("ready"):
                continue
            state = cs.get("state") or {}
            waiting = state.get("waiting") or {}
            ended = state.get("terminated") or (cs.get("lastState") or {}).get("terminated") or {}
            parts = []
            if waiting.get("reason") not in _STARTING:
                parts.append(f"{waiting['reason']}: {waiting.get('message', '')}".rstrip(": "))
            if ended.get("reason") not in (None, "Completed"):
                ending = f"last terminated {ended['reason']} (exit code {ended.get('exitCode')})"
                said = _last_words(str(ended.get("message") or ""))
                parts.append(f"{ending}: {said}" if said else ending)
            if parts:
                return f"container {cs.get('name')}: {'; '.join(parts)}"
    return None


def _creation_refused(deployment: Manifest) -> str | None:
    """The API server's refusal of what the Deployment controller creates.

    The ReplicaSet controller records a refused pod (quota, LimitRange, an admission webhook) as its
    ReplicaFailure condition, reason FailedCreate, with the API server's message; the Deployment
    controller copies that condition onto the Deployment in the same sync. A refused ReplicaSet is its
    Progressing condition, reason ReplicaSetCreateError.
    """
    for c in (deployment.get("status") or {}).get("conditions") or []:
        if (c.get("type"), c.get("status"), c.get("reason")) == ("ReplicaFailure", "True", "FailedCreate"):
            return f"cannot create pods: {c.get('message') or 'pod creation failed'}"
        if (c.get("type"), c.get("status"), c.get("reason")) == ("Progressing", "False", "ReplicaSetCreateError"):
            return str(c.get("message") or "cannot create a ReplicaSet")
    return None


def _progress_reason(deployment: Manifest) -> str | None:
    for c in (deployment.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Progressing":
            return str(c.get("reason") or "")
    return None


def _deadline_exceeded(deployment: Manifest) -> str | None:
    for c in (deployment.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Progressing" and c.get("reason") == "ProgressDeadlineExceeded":
            return str(c.get("message") or "progress deadline exceeded")
    return None


def component_state(name: str, deployment: Manifest | None, pods: Sequence[Manifest]) -> ComponentState:
    """One Deployment's state.

    Lost capacity is told from capacity not yet reached by the Deployment controller's own record:
    its Progressing condition keeps reason ``NewReplicaSetAvailable`` from the last completed rollout
    until a rollout or scale-up makes progress again, so pods missing while it still says so were lost,
    not yet to come.
    """
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
    counts = (desired, ready, updated, available)
    template_current = observed >= generation and updated == desired and total == desired
    if template_current and available == desired:
        return ComponentState(name, *counts, reason=None)

    degraded = template_current and _progress_reason(deployment) == "NewReplicaSetAvailable"
    # Most specific first: what Kubernetes refused or cannot do explains a component better than the
    # rollout it holds up, so "rolling out" is said only while nothing is stuck.
    refused = _creation_refused(deployment)
    if refused:
        return ComponentState(name, *counts, cond.FAILED_CREATE, f"{name}: {refused}", degraded)
    unschedulable = _unschedulable(pods)
    if unschedulable:
        return ComponentState(
            name, *counts, cond.INSUFFICIENT_CAPACITY, f"{name}: pods cannot be scheduled: {unschedulable}", degraded
        )
    trouble = _container_trouble(pods)
    detail = f" ({trouble})" if trouble else ""
    deadline = _deadline_exceeded(deployment)
    if deadline:
        return ComponentState(name, *counts, cond.PROGRESS_DEADLINE_EXCEEDED, f"{name}: {deadline}{detail}", degraded)
    if not template_current and not trouble:
        return ComponentState(
            name, *counts, cond.UPDATING,
            f"{name}: rolling out, {updated}/{desired} updated, {available}/{desired} available",
        )  # fmt: skip
    return ComponentState(
        name, *counts, cond.PODS_NOT_READY, f"{name}: {available}/{desired} pods available{detail}", degraded
    )


def combine(name: str, parts: Sequence[ComponentState]) -> ComponentState:
    """One stage served by several Deployments (vLLM-Omni's head and its extra replicas): counts add up,
    the least ready part explains the whole."""
    not_ready = [p for p in parts if not p.is_ready]
    worst = min(not_ready, key=lambda c: cond.REASON_PRIORITY.index(c.reason or cond.UPDATING)) if not_ready else None
    return ComponentState(
        name,
        sum(p.desired for p in parts),
        sum(p.ready for p in parts),
        sum(p.updated for p in parts),
        sum(p.available for p in parts),
        reason=worst.reason if worst else None,
        message="; ".join(p.message for p in not_ready),
        degraded=any(p.degraded for p in parts),
    )


def _stage_reason(state: ComponentState) -> str:
    if state.degraded:
        return cond.CAPACITY_LOST
    if state.reason is None:
        return cond.SCALED_TO_ZERO if state.desired == 0 else cond.STAGE_READY
    return state.reason


class StatusView(Protocol):
    """What status needs of a plan (the omnimodel runtime's Plan and vLLM-Omni's VllmPlan both have it)."""

    @property
    def endpoint(self) -> str: ...

    @property
    def modalities(self) -> tuple[str, ...]: ...

    def stages_for(self, modality: str) -> list[str]: ...

    def accelerator_of(self, stage: str) -> AcceleratorRequest: ...

    def service_of(self, stage: str) -> str: ...

    def wakes(self, stage: str) -> bool:
        """True for a stage that may sit at zero: the gateway holds its requests while it wakes."""
        ...


def _accelerator_text(plan: StatusView, stage: str) -> str:
    acc = plan.accelerator_of(stage)
    if acc.count == 0:
        return "cpu"
    return f"{acc.count}x {acc.vendor.value}" + (f" {acc.product}" if acc.product else "")


def autoscaler_status(hpa: Manifest | None) -> AutoscalerStatus | None:
    if hpa is None:
        return None
    status = hpa.get("status") or {}
    return AutoscalerStatus(
        kind=hpa["kind"],
        name=hpa["metadata"]["name"],
        current_replicas=int(status.get("currentReplicas", 0)),
        desired_replicas=int(status.get("desiredReplicas", 0)),
    )


@dataclass(frozen=True)
class Problems:
    """What went wrong outside the children's own state: apply failures and name conflicts."""

    apply_errors: tuple[str, ...] = ()
    conflicts: tuple[str, ...] = ()
    # "<field>: Secret <ns>/<name> not found" (or has no key), one per Secret the spec names and lacks.
    missing_secrets: tuple[str, ...] = ()


def _worst(states: Sequence[ComponentState]) -> ComponentState:
    return min(states, key=lambda c: cond.REASON_PRIORITY.index(c.reason or cond.UPDATING))


def compute_status(
    plan: StatusView,
    stages: Sequence[ComponentState],
    gateway: ComponentState,
    hpas: Mapping[str, Manifest],
    old: OmniModelStatus,
    generation: int | None,
    now: str,
    problems: Problems | None = None,
    autoscalers: Mapping[str, AutoscalerStatus] | None = None,
    weights: Weights | None = None,
) -> OmniModelStatus:
    """Roll component state up into conditions and the per-stage table."""
    problems = problems or Problems()
    conditions: list[dict[str, Any]] = [
        c.model_dump(by_alias=True)
        for c in old.conditions or ()
        # WeightsReady belongs to models the operator fetches for; it goes when the fetch does.
        if weights is not None or c.type != cond.WEIGHTS_READY
    ]

    def put(type_: str, status: bool, reason: str, message: str) -> None:
        nonlocal conditions
        conditions = cond.set_condition(conditions, type_, status, reason, message, generation, now)

    components = [*stages, gateway]
    not_ready = [c for c in components if not c.is_ready]
    at_zero = {s.name for s in stages if s.is_ready and s.desired == 0}
    # A stage the autoscaler took to zero (minReplicas 0) still serves: the gateway holds the request
    # and the autoscaler wakes it. Only a stage at zero that cannot wake makes its modality unservable.
    idle = {name for name in at_zero if plan.wakes(name)}
    at_zero -= idle
    servable = [m for m in plan.modalities if not any(name in at_zero for name in plan.stages_for(m))]
    if (gateway.is_ready and gateway.desired == 0) or (weights is not None and not weights.ready):
        servable = []
    if problems.conflicts:
        put(cond.READY, False, cond.NAME_CONFLICT, "; ".join(problems.conflicts))
    elif problems.apply_errors:
        put(cond.READY, False, cond.RECONCILE_ERROR, "; ".join(problems.apply_errors))
    elif problems.missing_secrets:
        put(cond.READY, False, cond.SECRET_NOT_FOUND, "; ".join(problems.missing_secrets))
    elif weights is not None and weights.failed:
        put(cond.READY, False, cond.WEIGHTS_FAILED, weights.condition_message)
    elif weights is not None and not weights.ready:
        # The stage pods wait for the weights in their init container: that, not their pods, is the news.
        put(cond.READY, False, cond.FETCHING_WEIGHTS, weights.condition_message)
    elif not_ready:
        worst = _worst(not_ready)
        put(cond.READY, False, worst.reason or cond.UPDATING, "; ".join(c.message for c in not_ready))
    elif not servable:
        put(cond.READY, False, cond.SCALED_TO_ZERO, "nothing can be served: " + _zero_text(gateway, at_zero))
    elif at_zero:
        lost = [m for m in plan.modalities if m not in servable]
        put(
            cond.READY, True, cond.STAGES_SCALED_TO_ZERO,
            f"serving {', '.join(servable)}; {', '.join(lost)} output needs "
            f"{', '.join(sorted(at_zero))} (scaled to 0)",
        )  # fmt: skip
    else:
        woken = f"; {', '.join(sorted(idle))} idle at 0 replicas (woken by the next request)" if idle else ""
        put(cond.READY, True, cond.ALL_READY, f"{len(stages)} stage(s) and the gateway are available{woken}")

    progressing = [c for c in components if not c.is_ready and not c.degraded]
    if problems.conflicts:
        put(cond.PROGRESSING, False, cond.NAME_CONFLICT, "nothing applied: a child name is taken")
    elif weights is not None and not weights.ready and not weights.failed:
        put(cond.PROGRESSING, True, cond.FETCHING_WEIGHTS, weights.condition_message)
    elif progressing:
        worst = _worst(progressing)
        put(cond.PROGRESSING, True, worst.reason or cond.UPDATING, "; ".join(c.message for c in progressing))
    else:
        put(cond.PROGRESSING, False, cond.ROLLOUT_COMPLETE, "every stage runs the current spec")

    if weights is not None:
        put(cond.WEIGHTS_READY, weights.ready, weights.condition_reason, weights.condition_message)

    degraded = [c for c in components if c.degraded]
    if degraded:
        put(cond.DEGRADED, True, _worst(degraded).reason or "", "; ".join(c.message for c in degraded))
    else:
        put(cond.DEGRADED, False, cond.AS_EXPECTED, "")

    table = [
        StageStatus(
            name=s.name,
            replicas=s.desired,
            ready_replicas=s.ready,
            updated_replicas=s.updated,
            available_replicas=s.available,
            reason=_stage_reason(s),
            accelerator=_accelerator_text(plan, s.name),
            service=plan.service_of(s.name),
            message="" if s.is_ready else s.message,
            autoscaler=(autoscalers or {}).get(s.name) or autoscaler_status(hpas.get(s.name)),
        )
        for s in stages
    ]
    ready_count = sum(1 for s in stages if s.is_ready)
    return OmniModelStatus.model_validate(
        {
            "observedGeneration": generation,
            "conditions": conditions,
            "stages": [t.model_dump(by_alias=True, exclude_none=True) for t in table],
            "gateway": ComponentStatus(
                replicas=gateway.desired,
                ready_replicas=gateway.ready,
                updated_replicas=gateway.updated,
                available_replicas=gateway.available,
                reason=_stage_reason(gateway),
                message="" if gateway.is_ready else gateway.message,
            ).model_dump(by_alias=True),
            "readyStages": f"{ready_count}/{len(stages)}",
            "endpoint": plan.endpoint,
            "servedModalities": servable,
            **({"weights": weights.status.model_dump(by_alias=True, exclude_none=True)} if weights else {}),
        }
    )


def _zero_text(gateway: ComponentState, at_zero: Iterable[str]) -> str:
    if gateway.desired == 0:
        return "the gateway is scaled to 0"
    return f"{', '.join(sorted(at_zero))} scaled to 0"


def invalid_status(message: str, old: OmniModelStatus, generation: int | None, now: str) -> OmniModelStatus:
    """Ready=False/InvalidSpec; children and the last good stage table are left as they were."""
    conditions = cond.set_condition(
        [c.model_dump(by_alias=True) for c in old.conditions or ()],
        cond.READY, False, cond.INVALID_SPEC, message, generation, now,
    )  # fmt: skip
    conditions = cond.set_condition(
        conditions, cond.PROGRESSING, False, cond.INVALID_SPEC, "nothing applied: the spec is invalid",
        generation, now,
    )  # fmt: skip
    return old.model_copy(update={"observed_generation": generation, "conditions": _conditions(conditions)})


def _conditions(raw: Sequence[Mapping[str, Any]]) -> list[Any]:
    return OmniModelStatus.model_validate({"conditions": list(raw)}).conditions or []


def status_dict(status: OmniModelStatus) -> dict[str, Any]:
    """The JSON written to the status subresource (camelCase, unset fields left out)."""
    return status.model_dump(by_alias=True, exclude_none=True, mode="json")
