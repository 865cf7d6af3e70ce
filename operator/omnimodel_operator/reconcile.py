"""The one level-based reconcile: spec → plan → apply what drifted → prune → status from live objects.

Reads come from the watch-fed cache (:class:`Observed`), so a pass over an OmniModel whose children
match costs no API request at all; writes go out only where :func:`~omnimodel_operator.drift.drift`
finds a difference. Called by the controller for every event on an OmniModel or one of its children
and by its periodic safety-net pass; the kopf handlers only feed the controller.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from omnimodel_operator import conditions as cond
from omnimodel_operator import constants as C
from omnimodel_operator import naming
from omnimodel_operator.api.v1alpha1 import AutoscalerStatus, OmniModelSpec, OmniModelStatus
from omnimodel_operator.builders import Manifest
from omnimodel_operator.builders.gateway import API_KEY_SECRET_KEY
from omnimodel_operator.builders.weights import fetches, job_name
from omnimodel_operator.drift import drift
from omnimodel_operator.kube import ApiError, KubeClient
from omnimodel_operator.observed import Key, Observed
from omnimodel_operator.runtimes import Runtime, render, resolve
from omnimodel_operator.settings import OperatorSettings
from omnimodel_operator.spec import InvalidSpec
from omnimodel_operator.status import Problems, compute_status, invalid_status, status_dict
from omnimodel_operator.weights import keep_stage_bytes, known_stage_bytes, weights_state

# The label the Job controller puts on its pods (Kubernetes 1.27+; the bare job-name too).
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
# How soon a pass that found a named Secret missing looks again. Secrets are looked up by name rather than
# watched: a watch would stream every Secret of every watched namespace (Helm releases, tokens) into the
# operator, and the chart grants no list/watch on them. So a Secret is read when the spec changes, and
# every this many seconds while it is missing, which is how its creation is noticed.
SECRET_RECHECK_SECONDS = 10.0


def utc_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Outcome:
    applied: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    status: dict[str, Any] = field(default_factory=dict)
    invalid: InvalidSpec | None = None
    # "<Kind> <ns>/<name>: <API server message>", one per child the API server refused.
    errors: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    # Whether any refusal may go away by itself (5xx, 429, timeouts): retry soon rather than later.
    transient: bool = False
    # Seconds until this OmniModel should be reconciled again regardless of events (a Secret it names is missing).
    recheck_after: float | None = None


def _ref(manifest: Mapping[str, Any]) -> str:
    return f"{manifest['kind']} {manifest['metadata'].get('namespace', '')}/{manifest['metadata']['name']}"


def _key(manifest: Mapping[str, Any]) -> Key:
    return (manifest["kind"], manifest["metadata"]["name"])


def owned_by(obj: Mapping[str, Any], uid: str | None) -> bool:
    return any(r.get("uid") == uid and r.get("controller") for r in obj["metadata"].get("ownerReferences") or [])


def _controller_of(obj: Mapping[str, Any]) -> str:
    ref = next((r for r in obj["metadata"].get("ownerReferences") or [] if r.get("controller")), None)
    if ref is None:
        return "it is not managed by this OmniModel"
    if ref.get("kind") == C.KIND:
        return f"it belongs to OmniModel {ref.get('name')} (uid {ref.get('uid')})"
    return f"it is controlled by {ref.get('kind')} {ref.get('name')}"


def parse_status(raw: Mapping[str, Any] | None) -> OmniModelStatus:
    """The status as last written; a status no model can read (hand-edited) counts as empty."""
    try:
        return OmniModelStatus.model_validate(raw or {})
    except ValidationError:
        return OmniModelStatus()


async def _conflicts(client: KubeClient, missing: Sequence[Manifest], uid: str | None) -> list[str]:
    """Children the cache does not show as ours may still exist under another owner (a name collision
    between two OmniModels, or an object someone created by hand): look before taking anything over."""

    async def one(manifest: Manifest) -> str | None:
        meta = manifest["metadata"]
        live = await client.get(manifest["apiVersion"], manifest["kind"], meta["namespace"], meta["name"])
        if live is None or owned_by(live, uid):
            return None
        return f"{_ref(manifest)} exists and {_controller_of(live)}"

    found = await asyncio.gather(*(one(m) for m in missing))
    return [f for f in found if f is not None]


def _failure(manifest: Mapping[str, Any], err: ApiError, outcome: Outcome) -> None:
    outcome.errors.append(f"{_ref(manifest)}: {err.message or err.reason or err.status}")
    outcome.transient = outcome.transient or err.transient


async def _apply_children(
    client: KubeClient, desired: Sequence[Manifest], live: Mapping[Key, Manifest], outcome: Outcome
) -> dict[Key, Manifest]:
    """Apply what drifted; children the API server refuses are recorded, and the others still converge."""
    current: dict[Key, Manifest] = {}

    async def apply(manifest: Manifest) -> None:
        key = _key(manifest)
        if drift(manifest, live.get(key)) is None:
            current[key] = live[key]
            return
        try:
            current[key] = await client.apply(manifest, C.FIELD_MANAGER)
        except ApiError as err:
            _failure(manifest, err, outcome)
            return
        outcome.applied.append(_ref(manifest))

    # The ConfigMap first: pods that mount it should never start before it exists.
    await apply(desired[0])
    await asyncio.gather(*(apply(m) for m in desired[1:]))
    outcome.applied.sort()
    return current


async def _prune(client: KubeClient, stale: Sequence[Manifest], outcome: Outcome) -> None:
    async def delete(obj: Manifest) -> None:
        try:
            await client.delete(obj["apiVersion"], obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        except ApiError as err:
            _failure(obj, err, outcome)
            return
        outcome.deleted.append(_ref(obj))

    await asyncio.gather(*(delete(o) for o in stale))
    outcome.deleted.sort()


def _status(
    runtime: Runtime,
    current: Mapping[Key, Manifest],
    pods: Sequence[Manifest],
    old: OmniModelStatus,
    generation: int | None,
    now: str,
    problems: Problems,
    autoscalers: Mapping[str, AutoscalerStatus],
    progress: Mapping[str, Any] | None = None,
) -> OmniModelStatus:
    plan = runtime.plan
    hpas = {
        sp.name: hpa
        for sp in plan.stages
        if (hpa := current.get(("HorizontalPodAutoscaler", naming.stage_name(plan.name, sp.name)))) is not None
    }
    weights = None
    if fetches(plan):
        job = job_name(plan)
        job_pods = [p for p in pods if (p["metadata"].get("labels") or {}).get(JOB_NAME_LABEL) == job]
        weights = weights_state(job, plan.spec.model.revision, current.get(("Job", job)), job_pods, progress)
        weights = keep_stage_bytes(weights, old.weights)
    stages, gateway = runtime.components(current, pods)
    return compute_status(plan, stages, gateway, hpas, old, generation, now, problems, autoscalers, weights)


def merge_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON merge patch (RFC 7386) from ``old`` to ``new``: a key gone at any depth is nulled, since a
    merge patch keeps whatever it does not name (a fetch's failure reason would outlive its success)."""
    out: dict[str, Any] = {k: None for k in old if k not in new}
    for key, value in new.items():
        before = old.get(key)
        out[key] = merge_patch(before, value) if isinstance(value, Mapping) and isinstance(before, Mapping) else value
    return out


async def write_status(
    client: KubeClient, body: Mapping[str, Any], old: Mapping[str, Any], new: Mapping[str, Any], now: str
) -> bool:
    """Patch status if it changed; post one Event when Ready's status or reason changed. True if written."""
    if new == old:
        return False
    meta = body["metadata"]
    patch = merge_patch(old, new)
    await client.patch_status(C.API_VERSION, C.KIND, meta["namespace"], meta["name"], patch)
    for event in (weights_event(body, old, new, now), transition_event(body, old, new, now)):
        if event is not None:
            # An Event is a courtesy: losing one must not fail (and so repeat) a pass whose status is written.
            with contextlib.suppress(ApiError):
                await client.create(event)
    return True


def weights_event(body: Mapping[str, Any], old: Mapping[str, Any], new: Mapping[str, Any], now: str) -> Manifest | None:
    """One Event when the fetch completes (a failure shows as Ready's WeightsFailed transition)."""
    before = (old.get("weights") or {}).get("state")
    after = new.get("weights") or {}
    if after.get("state") != "Complete" or before == "Complete":
        return None
    return event(body, "Normal", "WeightsFetched", str(after.get("message") or ""), now)


def transition_event(
    body: Mapping[str, Any], old: Mapping[str, Any], new: Mapping[str, Any], now: str
) -> Manifest | None:
    """One Event when Ready's status or reason changes, never on every pass."""
    before = cond.find(old.get("conditions"), cond.READY)
    after = cond.find(new.get("conditions"), cond.READY)
    if after is None:
        return None
    if before is not None and (before["status"], before["reason"]) == (after["status"], after["reason"]):
        return None
    if after["status"] == "True":
        return event(body, "Normal", "Ready", after["message"], now)
    if after["reason"] == cond.UPDATING:
        return event(body, "Normal", "RollingOut", after["message"], now)
    if after["reason"] == cond.FETCHING_WEIGHTS:
        return event(body, "Normal", cond.FETCHING_WEIGHTS, after["message"], now)
    return event(body, "Warning", after["reason"], after["message"], now)


def event(body: Mapping[str, Any], type_: str, reason: str, message: str, now: str) -> Manifest:
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


def secret_refs(spec: OmniModelSpec) -> list[tuple[str, str, str]]:
    """(field, Secret name, key) of every Secret the spec names."""
    refs = []
    if spec.gateway.api_key_secret:
        refs.append(("spec.gateway.apiKeySecret", spec.gateway.api_key_secret, API_KEY_SECRET_KEY))
    if spec.model.token_secret is not None:
        refs.append(("spec.model.tokenSecret", spec.model.token_secret.name, spec.model.token_secret.key))
    return refs


async def missing_secrets(client: KubeClient, namespace: str, spec: OmniModelSpec) -> tuple[str, ...]:
    """What the spec's Secrets lack, one line each naming the field; a pod would otherwise sit in
    CreateContainerConfigError (or, on a node that only simulates pods, look ready without its key)."""
    out = []
    for field_path, name, key in secret_refs(spec):
        try:
            secret = await client.get("v1", "Secret", namespace, name)
        except ApiError as err:
            if err.status == 403:  # the operator may not read Secrets here: the kubelet will say it instead
                continue
            raise
        if secret is None:
            out.append(f"{field_path}: Secret {namespace}/{name} not found")
        elif key not in (secret.get("data") or {}):
            out.append(f"{field_path}: Secret {namespace}/{name} has no key {key}")
    return tuple(out)


def _secrets_due(old: OmniModelStatus, generation: int | None) -> bool:
    """Look the Secrets up for a spec not seen yet, and again while one was missing; not on every pass (a pass
    over an unchanged OmniModel sends no request)."""
    ready = cond.find([c.model_dump(by_alias=True) for c in old.conditions or ()], cond.READY)
    return old.observed_generation != generation or (ready or {}).get("reason") == cond.SECRET_NOT_FOUND


async def reconcile(
    client: KubeClient,
    body: Mapping[str, Any],
    observed: Observed,
    settings: OperatorSettings,
    now: Callable[[], str] = utc_now,
    *,
    last_status: Mapping[str, Any] | None = None,
    autoscalers: Mapping[str, AutoscalerStatus] | None = None,
    weights_progress: Mapping[str, Any] | None = None,
) -> Outcome:
    """Bring one OmniModel's children and status in line with its spec.

    ``last_status`` is the status this operator last wrote, when the cached ``body`` may not show it
    yet: status belongs to the operator alone, so its own last write is the freshest copy and a pass
    right after a write neither patches status again nor posts the transition Event twice.
    """
    meta = body["metadata"]
    name, namespace, uid = meta["name"], meta["namespace"], meta.get("uid")
    generation = meta.get("generation")
    old_raw: Mapping[str, Any] = last_status if last_status is not None else body.get("status") or {}
    old = parse_status(old_raw)
    outcome = Outcome()
    try:
        runtime = resolve(name, namespace, body.get("spec") or {}, settings, uid=uid)
    except InvalidSpec as err:
        # Nothing is applied and nothing deleted: the last good children keep serving.
        outcome.invalid = err
        outcome.status = status_dict(invalid_status(str(err), old, generation, now()))
        await write_status(client, body, old_raw, outcome.status, now())
        return outcome

    missing = await missing_secrets(client, namespace, runtime.plan.spec) if _secrets_due(old, generation) else ()
    if missing:
        outcome.recheck_after = SECRET_RECHECK_SECONDS
    if fetches(runtime.plan):
        # The stages' weights as the fetch reported them (status): CPU stages request memory to fit them.
        observed = replace(observed, stage_bytes=known_stage_bytes(old.weights, job_name(runtime.plan)))
    desired = render(runtime, settings, observed)
    live = {key: obj for key, obj in observed.objects.items() if owned_by(obj, uid)}
    wanted = {_key(m) for m in desired}
    outcome.conflicts = await _conflicts(client, [m for m in desired if _key(m) not in live], uid)
    if outcome.conflicts:
        # Take nothing over and delete nothing until the name is free.
        current: dict[Key, Manifest] = dict(live)
    else:
        current = await _apply_children(client, desired, live, outcome)
        await _prune(client, [obj for key, obj in live.items() if key not in wanted], outcome)
    problems = Problems(apply_errors=tuple(outcome.errors), conflicts=tuple(outcome.conflicts), missing_secrets=missing)
    status = _status(
        runtime, current, observed.pods, old, generation, now(), problems, autoscalers or {}, weights_progress
    )
    outcome.status = status_dict(status)
    await write_status(client, body, old_raw, outcome.status, now())
    return outcome
