"""An in-memory API server for component tests of the reconcile and the controller.

Models what an operator's correctness depends on: server-side apply with per-manager field ownership
(fields a manager stops applying are removed; ``metadata.managedFields`` is reported in the API
server's ``fieldsV1`` shape, with lists owned whole), updates by other managers that take over the
fields they change (``kubectl set image``), ``metadata.generation`` bumped on spec changes, label
selection, status patches and garbage collection of dependents. Every request is recorded, reads
too, so tests can assert what a pass cost. ``snapshot()`` plays the controller's watch-fed cache.
"""

from __future__ import annotations

import copy
import itertools
import uuid
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from omnimodel_operator import constants as C
from omnimodel_operator import naming
from omnimodel_operator.kube import ApiError, Manifest
from omnimodel_operator.observed import Observed

Path = tuple[str, ...]


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _leaves(obj: Any, prefix: Path = ()) -> set[Path]:
    """Field paths an object sets; lists count as one atomic field."""
    if isinstance(obj, dict) and obj:
        out: set[Path] = set()
        for key, value in obj.items():
            out |= _leaves(value, (*prefix, key))
        return out
    return {prefix}


def _get(obj: Any, path: Path) -> Any:
    for key in path:
        if not isinstance(obj, dict) or key not in obj:
            return None
        obj = obj[key]
    return obj


def _remove(obj: dict[str, Any], path: Path) -> None:
    node: Any = obj
    for key in path[:-1]:
        if not isinstance(node, dict) or key not in node:
            return
        node = node[key]
    if isinstance(node, dict):
        node.pop(path[-1], None)


def _merge(base: dict[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if value is None:  # RFC 7386: null deletes, at any depth
            out.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _fields_v1(paths: set[Path]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path in paths:
        node = tree
        for key in path:
            node = node.setdefault(f"f:{key}", {})
    return tree


_UNTRACKED = {("apiVersion",), ("kind",), ("metadata", "name"), ("metadata", "namespace")}
Owners = dict[str, tuple[str, set[Path]]]  # manager -> (operation, fields)


class FakeKube:
    """In-memory KubeClient; see the module docstring for what it models."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str, str], Manifest] = {}
        self.owned: dict[tuple[str, str, str, str], Owners] = {}
        self.requests: list[tuple[str, str, str]] = []
        self.fail_next: list[ApiError] = []
        # (verb, kind) -> error raised on every such request until removed (a child the server refuses).
        self.refuse: dict[tuple[str, str], ApiError] = {}
        self._rv = itertools.count(1)

    @property
    def writes(self) -> list[tuple[str, str, str]]:
        return [r for r in self.requests if r[0] in ("apply", "delete", "status", "create", "scale")]

    # helpers for tests -----------------------------------------------------------------------
    def key(self, manifest: Manifest) -> tuple[str, str, str, str]:
        meta = manifest["metadata"]
        return (manifest["apiVersion"], manifest["kind"], meta.get("namespace", ""), meta["name"])

    def find(self, kind: str, name: str, namespace: str | None = None) -> Manifest | None:
        for (_, k, ns, n), obj in self.objects.items():
            if k == kind and n == name and (namespace is None or ns == namespace):
                return obj
        return None

    def of_kind(self, kind: str) -> list[Manifest]:
        return [o for (_, k, _, _), o in sorted(self.objects.items()) if k == kind]

    def put(self, manifest: Manifest) -> Manifest:
        """Create an object as a user would (kubectl create); returns the stored copy."""
        obj = copy.deepcopy(manifest)
        meta = obj.setdefault("metadata", {})
        if "name" not in meta and "generateName" in meta:
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        meta.setdefault("namespace", "default")
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("generation", 1)
        meta.setdefault("creationTimestamp", _now())
        meta["resourceVersion"] = str(next(self._rv))
        self.objects[self.key(obj)] = obj
        return copy.deepcopy(obj)

    def set_status(self, kind: str, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        """What a controller (or kubelet) would report."""
        obj = self.find(kind, name, namespace)
        assert obj is not None, f"{kind} {namespace}/{name} not found"
        obj["status"] = copy.deepcopy(dict(status))
        obj["metadata"]["resourceVersion"] = str(next(self._rv))

    def mark_rolled_out(self) -> None:
        """What the deployment controller reports once every pod of every Deployment is updated and available."""
        for deploy in self.of_kind("Deployment"):
            n = deploy["spec"].get("replicas", 1)
            meta = deploy["metadata"]
            status = {"observedGeneration": meta["generation"], "replicas": n, "readyReplicas": n}
            status |= {"updatedReplicas": n, "availableReplicas": n}
            self.set_status("Deployment", meta["namespace"], meta["name"], status)

    def update_as(self, manager: str, kind: str, namespace: str, name: str, change: Callable[[Manifest], None]) -> None:
        """An Update by another client (kubectl edit/set/scale): it takes over the fields it changes."""
        obj = self.find(kind, name, namespace)
        assert obj is not None, f"{kind} {namespace}/{name} not found"
        key = self.key(obj)
        new = copy.deepcopy(obj)
        change(new)
        changed = {p for p in _leaves(self._tracked(new)) if _get(new, p) != _get(obj, p)}
        owners = self.owned.setdefault(key, {})
        for other, (operation, fields) in list(owners.items()):
            owners[other] = (operation, fields - changed)
        operation, mine = owners.get(manager, ("Update", set()))
        owners[manager] = (operation, mine | changed)
        if new.get("spec") != obj.get("spec"):
            new["metadata"]["generation"] = obj["metadata"].get("generation", 1) + 1
        new["metadata"]["resourceVersion"] = str(next(self._rv))
        self.objects[key] = new
        self._report_fields(key)

    def snapshot(self, omnimodel: str, namespace: str = "ml") -> Observed:
        """What the controller's watch-fed cache would hold for ``omnimodel``."""
        instance = {C.LABEL_INSTANCE: naming.instance_label(omnimodel), C.LABEL_MANAGED_BY: C.MANAGED_BY}
        objects: dict[tuple[str, str], Manifest] = {}
        pods: list[Manifest] = []
        for (_, kind, ns, name), obj in sorted(self.objects.items()):
            labels = obj["metadata"].get("labels") or {}
            if ns != namespace or any(labels.get(k) != v for k, v in instance.items()):
                continue
            if kind == "Pod":
                pods.append(copy.deepcopy(obj))
            elif kind not in ("Event", C.KIND):
                objects[(kind, name)] = copy.deepcopy(obj)
        return Observed(objects=objects, pods=pods)

    @staticmethod
    def _tracked(obj: Manifest) -> Manifest:
        out = {k: v for k, v in obj.items() if k not in ("status", "apiVersion", "kind")}
        meta = {
            k: v
            for k, v in obj.get("metadata", {}).items()
            if k in ("labels", "annotations", "ownerReferences", "finalizers")
        }
        return {**out, "metadata": meta}

    def _report_fields(self, key: tuple[str, str, str, str]) -> None:
        obj = self.objects.get(key)
        if obj is None:
            return
        obj["metadata"]["managedFields"] = [
            {"manager": m, "operation": op, "fieldsV1": _fields_v1(fields - _UNTRACKED)}
            for m, (op, fields) in sorted(self.owned.get(key, {}).items())
            if fields - _UNTRACKED
        ]

    def _check(self, verb: str, kind: str) -> None:
        if self.fail_next:
            raise self.fail_next.pop(0)
        if (verb, kind) in self.refuse:
            raise self.refuse[(verb, kind)]

    # KubeClient ------------------------------------------------------------------------------
    async def apply(self, manifest: Manifest, field_manager: str) -> Manifest:
        self.requests.append(("apply", manifest["kind"], manifest["metadata"]["name"]))
        self._check("apply", manifest["kind"])
        key = self.key(manifest)
        new_fields = _leaves(self._tracked(manifest))
        live = self.objects.get(key)
        owners = self.owned.setdefault(key, {})
        if live is None:
            self.put(manifest)
            owners[field_manager] = ("Apply", new_fields)
            self._report_fields(key)
            return copy.deepcopy(self.objects[key])
        base = copy.deepcopy(live)
        others = set().union(*(f for m, (_, f) in owners.items() if m != field_manager))
        for path in owners.get(field_manager, ("Apply", set()))[1] - new_fields - others:
            _remove(base, path)
        merged = _merge(base, manifest)
        # A forced apply takes its fields back from whoever changed them.
        for other, (operation, fields) in list(owners.items()):
            if other != field_manager:
                owners[other] = (operation, fields - new_fields)
        owners[field_manager] = ("Apply", new_fields)
        if merged.get("spec") != live.get("spec"):
            merged["metadata"]["generation"] = live["metadata"].get("generation", 1) + 1
        if merged != live:
            merged["metadata"]["resourceVersion"] = str(next(self._rv))
            self.objects[key] = merged
        self._report_fields(key)
        return copy.deepcopy(self.objects[key])

    async def list(self, api_version: str, kind: str, namespace: str, labels: Mapping[str, str]) -> list[Manifest]:
        self.requests.append(("list", kind, namespace))
        self._check("list", kind)
        out = []
        for (av, k, ns, _), obj in sorted(self.objects.items()):
            obj_labels = obj["metadata"].get("labels") or {}
            if (
                (av, k) == (api_version, kind)
                and namespace in ("", ns)
                and all(obj_labels.get(lk) == lv for lk, lv in labels.items())
            ):
                out.append(copy.deepcopy(obj))
        return out

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> Manifest | None:
        self.requests.append(("get", kind, name))
        self._check("get", kind)
        obj = self.objects.get((api_version, kind, namespace, name))
        return copy.deepcopy(obj) if obj else None

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        self.requests.append(("delete", kind, name))
        self._check("delete", kind)
        self.remove(api_version, kind, namespace, name)

    def remove(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        """Delete and garbage-collect dependents, as the controller-manager's GC would."""
        obj = self.objects.pop((api_version, kind, namespace, name), None)
        self.owned.pop((api_version, kind, namespace, name), None)
        if obj is None:
            return
        uid = obj["metadata"]["uid"]
        for key, child in list(self.objects.items()):
            refs = child["metadata"].get("ownerReferences") or []
            if any(r.get("uid") == uid for r in refs):
                self.remove(*key)

    async def patch_status(
        self, api_version: str, kind: str, namespace: str, name: str, status: Mapping[str, Any]
    ) -> Manifest:
        self.requests.append(("status", kind, name))
        self._check("status", kind)
        obj = self.objects.get((api_version, kind, namespace, name))
        if obj is None:
            raise ApiError(404, "NotFound", f"{kind} {namespace}/{name} not found")
        # merge-patch semantics: None deletes a key
        merged = _merge(obj.get("status") or {}, status)
        obj["status"] = {k: v for k, v in merged.items() if v is not None}
        obj["metadata"]["resourceVersion"] = str(next(self._rv))
        return copy.deepcopy(obj)

    async def scale(
        self, api_version: str, kind: str, namespace: str, name: str, replicas: int, field_manager: str
    ) -> Manifest:
        self.requests.append(("scale", kind, name))
        self._check("scale", kind)

        def set_replicas(obj: Manifest) -> None:
            obj["spec"]["replicas"] = replicas

        self.update_as(field_manager, kind, namespace, name, set_replicas)
        found = self.find(kind, name, namespace)
        assert found is not None
        return copy.deepcopy(found)

    async def create(self, manifest: Manifest) -> Manifest:
        meta = manifest["metadata"]
        self.requests.append(("create", manifest["kind"], meta.get("name") or meta.get("generateName", "")))
        self._check("create", manifest["kind"])
        return self.put(manifest)


class FakeCache:
    """The controller's :class:`~omnimodel_operator.controller.Cache` over a :class:`FakeKube`: what a
    watch that never lags would show. ``stale`` freezes an OmniModel's body as of a moment (a watch
    event not yet delivered)."""

    def __init__(self, kube: FakeKube) -> None:
        self.kube = kube
        self.stale: dict[tuple[str, str], Manifest] = {}

    def omnimodel(self, namespace: str, name: str) -> Manifest | None:
        if (namespace, name) in self.stale:
            return copy.deepcopy(self.stale[(namespace, name)])
        obj = self.kube.find(C.KIND, name, namespace)
        return copy.deepcopy(obj) if obj is not None else None

    def observed(self, namespace: str, name: str) -> Observed:
        return self.kube.snapshot(name, namespace)

    def omnimodel_keys(self) -> list[tuple[str, str]]:
        return [(ns, n) for (_, k, ns, n) in sorted(self.kube.objects) if k == C.KIND]

    def owners(self, namespace: str, instance: str) -> list[str]:
        return [n for ns, n in self.omnimodel_keys() if ns == namespace and naming.instance_label(n) == instance]
