"""PersistentVolumeClaims made Bound by the real controller-manager: one host directory per claim.

The test bed has no storage provisioner, so a claim stays Pending, and kube-scheduler's VolumeBinding
plugin keeps every pod that mounts it Pending too ("pod has unbound immediate PersistentVolumeClaims"),
on kwok's nodes as on any other. :func:`bind_claim` does what a static administrator does: it creates a
``hostPath`` PersistentVolume reserved for the claim (``claimRef`` with the claim's UID, so the PV
controller binds the claim at once instead of at its next 15 s resync), with the claim's capacity,
access modes and StorageClass name. A StorageClass that does not exist is no obstacle: only dynamic
provisioning needs the object (the controller logs ``ProvisioningFailed`` until the volume appears).
The scheduler then places the pods, and the volume's path is where the pod runner puts the claim.

The volumes are ``Retain``: the in-tree hostPath deleter would ``rm -rf`` the directory from the
controller-manager, which runs on this machine. Whoever binds deletes the volume (:func:`release`);
deleted while its claim exists, it goes once the claim does (``kubernetes.io/pv-protection``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from .kubeapi import ApiError, KubeAPI

__all__ = ["FOR_CLAIM", "bind_claim", "claim_host_path", "claim_volume", "release", "volume_name"]

#: On a volume bind_claim made: which claim it was made for (``<namespace>/<name>``).
FOR_CLAIM: Final = "testbed.omnimodel.io/claim"

_PVS: Final = "/api/v1/persistentvolumes"


def volume_name(namespace: str, claim: str) -> str:
    """``testbed-<namespace>-<claim>``, shortened with a hash past the 253 characters a name may have."""
    name = f"testbed-{namespace}-{claim}"
    if len(name) <= 253:
        return name
    return f"{name[:240]}-{hashlib.sha256(name.encode()).hexdigest()[:12]}"


def claim_volume(claim: Mapping[str, Any], host_path: Path) -> dict[str, Any]:
    """A hostPath PersistentVolume reserved for ``claim`` (as read from the API) and matching it."""
    meta, spec = claim["metadata"], claim.get("spec") or {}
    namespace = meta["namespace"]
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {
            "name": volume_name(namespace, meta["name"]),
            "labels": {"app.kubernetes.io/managed-by": "omnimodel-testbed"},
            "annotations": {FOR_CLAIM: f"{namespace}/{meta['name']}"},
        },
        "spec": {
            "capacity": {"storage": (spec.get("resources") or {}).get("requests", {}).get("storage", "1Gi")},
            "accessModes": list(spec.get("accessModes") or ["ReadWriteOnce"]),
            "volumeMode": spec.get("volumeMode", "Filesystem"),
            # "" matches a claim without a class (there is no default StorageClass here).
            "storageClassName": spec.get("storageClassName") or "",
            "persistentVolumeReclaimPolicy": "Retain",
            "claimRef": {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "namespace": namespace,
                "name": meta["name"],
                "uid": meta["uid"],
            },
            "hostPath": {"path": str(host_path), "type": "DirectoryOrCreate"},
        },
    }


def bind_claim(api: KubeAPI, namespace: str, claim: str, host_path: Path) -> str:
    """Make the existing claim ``namespace/claim`` Bound to a volume at ``host_path``; return the volume's
    name. A claim already bound (or with a volume reserved for it) is left as it is."""
    obj = api.get(f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/{claim}")
    bound: str | None = (obj.get("spec") or {}).get("volumeName")
    if bound:
        return bound
    host_path.mkdir(parents=True, exist_ok=True)
    volume = claim_volume(obj, host_path)
    try:
        api.create(_PVS, volume)
    except ApiError as exc:
        if exc.status != 409:
            raise
    name: str = volume["metadata"]["name"]
    return name


def claim_host_path(api: KubeAPI, namespace: str, claim: str) -> Path | None:
    """The directory of the hostPath (or local) volume ``namespace/claim`` is bound to, if it is."""
    try:
        obj = api.get(f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/{claim}")
        name = (obj.get("spec") or {}).get("volumeName")
        if not name or (obj.get("status") or {}).get("phase") != "Bound":
            return None
        spec = api.get(f"{_PVS}/{name}").get("spec") or {}
    except ApiError as exc:
        if exc.status == 404:
            return None
        raise
    source = spec.get("hostPath") or spec.get("local") or {}
    return Path(source["path"]) if source.get("path") else None


def release(api: KubeAPI, name: str) -> None:
    """Delete a volume :func:`bind_claim` made (gone at once, or once its claim is)."""
    try:
        api.delete(f"{_PVS}/{name}")
    except ApiError as exc:
        if exc.status != 404:
            raise
