"""Pieces every child manifest shares: metadata, owner references, pod security, volumes, probes."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from decimal import Decimal
from typing import Any, Final, Protocol

from omnimodel_operator import constants as C
from omnimodel_operator import naming
from omnimodel_operator.accelerators import accelerator_for
from omnimodel_operator.api.v1alpha1 import EnvVar, OmniModelSpec, Resources, Toleration
from omnimodel_operator.quantity import add_quantities, format_quantity, parse_quantity
from omnimodel_operator.settings import OperatorSettings
from omnimodel_runtime.pipeline import AcceleratorRequest

Manifest = dict[str, Any]


class Plan(Protocol):
    """What the shared builders read of a plan (both runtimes' plans have it)."""

    @property
    def name(self) -> str: ...

    @property
    def namespace(self) -> str: ...

    @property
    def spec(self) -> OmniModelSpec: ...

    @property
    def uid(self) -> str | None: ...


def owner_reference(plan: Plan) -> dict[str, Any]:
    assert plan.uid is not None
    return {
        "apiVersion": C.API_VERSION,
        "kind": C.KIND,
        "name": plan.name,
        "uid": plan.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def metadata(
    plan: Plan, name: str, labels: Mapping[str, str], annotations: Mapping[str, str] | None = None
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": plan.namespace, "labels": dict(labels)}
    if annotations:
        meta["annotations"] = dict(annotations)
    if plan.uid is not None:
        meta["ownerReferences"] = [owner_reference(plan)]
    return meta


def content_hash(payload: Any) -> str:
    """Stable hash of JSON-able data, for pod-template annotations that roll pods on change."""
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def env_list(env: Iterable[EnvVar] | None) -> list[dict[str, Any]]:
    return [e.model_dump(by_alias=True, exclude_none=True) for e in env or ()]


def merge_env(*groups: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Later groups win by name; order of first appearance is kept so output is stable."""
    merged: dict[str, dict[str, Any]] = {}
    for group in groups:
        for item in group:
            merged[item["name"]] = item
    return list(merged.values())


def tolerations_list(tolerations: Iterable[Toleration] | None) -> list[dict[str, Any]]:
    return [t.model_dump(by_alias=True, exclude_none=True) for t in tolerations or ()]


def dedupe(items: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    seen: set[str] = set()
    out = []
    for item in items:
        key = json.dumps(item, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(item)
    return out


def quantity(value: int | str) -> str:
    return str(value)


def _limit(request: str, ratio: float, resource: str) -> str | None:
    """``ratio`` × ``request``; None when the request is no quantity (the API server then refuses the
    container in its own words, which status shows)."""
    if ratio == 1:
        return request  # as written: what the API server reads back for a limit equal to the request
    try:
        return format_quantity(parse_quantity(request) * Decimal(str(ratio)), resource)
    except ValueError:
        return None


def resources_dict(
    resources: Resources | None,
    default_requests: Mapping[str, str],
    limit_ratios: Mapping[str, float],
    device_limits: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A container's requests and limits, so it is never BestEffort (first evicted) and a namespace
    whose ResourceQuota requires limits admits it.

    Requests: the spec's; a resource it neither requests nor limits from ``default_requests`` (one it
    only limits is requested at its limit, by the API server). Limits: the spec's; a requested resource
    it does not limit gets ``limit_ratios[resource]`` × its request (none for a ratio of 0 or a resource
    without a ratio). Devices are limits only (the API server copies them to requests), and the
    accelerator table wins over a hand-written device limit."""
    limits = {k: quantity(v) for k, v in ((resources.limits if resources else None) or {}).items()}
    own = {k: quantity(v) for k, v in ((resources.requests if resources else None) or {}).items()}
    requests = {**{k: v for k, v in default_requests.items() if k not in limits}, **own}
    for resource, ratio in limit_ratios.items():
        limit = _limit(requests[resource], ratio, resource) if ratio and resource in requests else None
        if limit is not None and resource not in limits:
            limits[resource] = limit
    limits.update(device_limits or {})
    out: dict[str, Any] = {}
    if limits:
        out["limits"] = dict(sorted(limits.items()))
    if requests:
        out["requests"] = dict(sorted(requests.items()))
    return out


# Beyond its weights, what a stage that holds them in host memory needs: the process, activations, buffers.
WEIGHTS_HEADROOM: Final = 1024**3


def stage_requests(
    settings: OperatorSettings, accelerator: AcceleratorRequest, weights_bytes: int | None = None
) -> dict[str, str]:
    """What a stage container requests unless its spec says otherwise: the process's own share
    (``stage_requests``) plus ``device_requests`` per device of a replica.

    A stage without devices holds its weights in host memory, so once their size is known
    (``weights_bytes``: what the fetch of an hf:// model reported for this stage) it requests at least
    that plus :data:`WEIGHTS_HEADROOM`. The size arrives after the stage's first pods exist (they wait for
    the fetch), so those pods are replaced once, while they still wait. A pvc:// or file:// model's size
    is never known: a stage that needs more sets ``resources``."""
    devices = accelerator.count if accelerator_for(accelerator.vendor).resource_name else 0
    if devices:
        return add_quantities((settings.stage_requests, 1), (settings.device_requests, devices))
    requests = dict(settings.stage_requests)
    if weights_bytes and "memory" in requests:
        need = Decimal(weights_bytes + WEIGHTS_HEADROOM)
        if need > parse_quantity(requests["memory"]):
            requests["memory"] = format_quantity(need, "memory")
    return requests


def stage_resources(
    resources: Resources | None,
    accelerator: AcceleratorRequest,
    settings: OperatorSettings,
    weights_bytes: int | None = None,
) -> dict[str, Any]:
    """A stage container's requests and limits: derived from its accelerator and its weights' size
    (:func:`stage_requests`), overridden by its spec."""
    return resources_dict(
        resources,
        stage_requests(settings, accelerator, weights_bytes),
        settings.limit_ratios,
        accelerator_for(accelerator.vendor).resources(accelerator),
    )


def service_account(plan: Plan) -> Manifest:
    """The identity every runtime pod of this OmniModel runs as: its own, so no pod shares the
    namespace's default ServiceAccount, and without an API token, because the runtime never calls the
    Kubernetes API."""
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": metadata(
            plan, naming.service_account_name(plan.name), naming.common_labels(plan.name, C.COMPONENT_RUNTIME)
        ),
        "automountServiceAccountToken": False,
    }


def pod_identity(plan: Plan) -> dict[str, Any]:
    return {"serviceAccountName": naming.service_account_name(plan.name), "automountServiceAccountToken": False}


def pod_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": C.RUNTIME_UID,
        "runAsGroup": C.RUNTIME_UID,
        "fsGroup": C.RUNTIME_UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def http_probes(port_name: str, *, startup_seconds: int) -> dict[str, Any]:
    """Startup and readiness on /health (503 until the engine is loaded and warm); liveness on /livez
    (process alive) so a gateway whose stage is down is taken out of rotation, not restarted.

    The startup probe runs every second, ``startup_seconds`` times: the kubelet holds readiness and
    liveness until it succeeds, so its period is added (half of it on average) to every pod's Ready;
    /health is a cheap in-process answer, and the allowance stays ``startup_seconds``."""
    return {
        "startupProbe": {
            "httpGet": {"path": C.HEALTH_PATH, "port": port_name},
            "periodSeconds": 1,
            "failureThreshold": max(1, startup_seconds),
        },
        "readinessProbe": {
            "httpGet": {"path": C.HEALTH_PATH, "port": port_name},
            "periodSeconds": 5,
            "failureThreshold": 2,
        },
        "livenessProbe": {
            "httpGet": {"path": "/livez", "port": port_name},
            "periodSeconds": 10,
            "failureThreshold": 3,
        },
    }


def runtime_container(
    name: str,
    command: str,
    port: int,
    *,
    image: str,
    pull_policy: str,
    args: Sequence[str] = (),
    env: list[dict[str, Any]],
    resources: dict[str, Any],
    mounts: list[dict[str, Any]],
    startup_seconds: int,
) -> dict[str, Any]:
    """What every long-running container of our runtime shares (a stage's, the gateway's): ``omnimodel
    <command>`` on the mounted pipeline file, on every address of the pod at ``port`` (kube-proxy and
    the probes reach the pod IP), hardened, probed on that port, its crash log as its termination message."""
    return {
        "name": name,
        "image": image,
        "imagePullPolicy": pull_policy,
        "command": ["omnimodel", command],
        "args": ["--pipeline", C.PIPELINE_PATH, *args, "--host", "0.0.0.0", "--port", str(port)],
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}],
        "env": env,
        "resources": resources,
        "volumeMounts": mounts,
        "securityContext": container_security_context(),
        # A crash's last log lines become its termination message, which status quotes (the exception).
        "terminationMessagePolicy": "FallbackToLogsOnError",
        **http_probes("http", startup_seconds=startup_seconds),
    }


def pipeline_volume(plan: Plan) -> tuple[dict[str, Any], dict[str, Any]]:
    volume = {
        "name": "pipeline",
        "configMap": {"name": naming.pipeline_configmap_name(plan.name)},
    }
    mount = {"name": "pipeline", "mountPath": C.PIPELINE_MOUNT_DIR, "readOnly": True}
    return volume, mount


def scratch_volumes() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """/tmp for a read-only root filesystem; /dev/shm in memory, because the 64 MiB container default
    breaks torch's shared-memory tensors and NCCL."""
    volumes = [
        {"name": "tmp", "emptyDir": {}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
    ]
    mounts = [
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    return volumes, mounts


def cache_claim_name(plan: Plan) -> str | None:
    """The claim behind ``model.cache``: the one named, or ``<name>-models`` created from a StorageClass."""
    cache = plan.spec.model.cache
    if cache is None:
        return None
    return cache.pvc or naming.dns_label(plan.name, "models")


def model_cache_volume(plan: Plan, *, read_only: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """/models: the cache claim, or without one an emptyDir of the pod's own (downloads start over on
    every new pod)."""
    claim = cache_claim_name(plan)
    ro: dict[str, Any] = {"readOnly": True} if read_only else {}
    source: dict[str, Any] = {"persistentVolumeClaim": {"claimName": claim, **ro}} if claim else {"emptyDir": {}}
    return {"name": "model-cache", **source}, {"name": "model-cache", "mountPath": C.MODEL_CACHE_DIR, **ro}


def model_source_volume(plan: Plan) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """A ``pvc://claim/path`` model source: the claim, read-only, where the runtime looks for it."""
    source = plan.spec.model.source
    if not source.startswith("pvc://"):
        return None
    claim = source.removeprefix("pvc://").split("/", 1)[0]
    volume = {"name": "model-source", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
    mount = {"name": "model-source", "mountPath": f"{C.PVC_ROOT}/{claim}", "readOnly": True}
    return volume, mount


def runtime_env(plan: Plan) -> list[dict[str, Any]]:
    """Env every runtime container gets: caches on writable volumes under a read-only root."""
    return [
        {"name": "HF_HOME", "value": f"{C.MODEL_CACHE_DIR}/hf"},
        {"name": "OMNIMODEL_MODEL_CACHE", "value": C.MODEL_CACHE_DIR},
        {"name": "XDG_CACHE_HOME", "value": "/tmp/.cache"},
        {"name": "HOME", "value": "/tmp"},
        *env_list(plan.spec.runtime.env),
    ]
