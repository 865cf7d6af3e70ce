"""The controller's read side over kopf indexes: OmniModels, their children and pods, as last watched.

Every index is keyed by ``(namespace, instance label)`` (children) or ``(namespace, name)``
(OmniModels); the values are deep copies of the objects as of their last watch event, so nothing here
changes under a running reconcile.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final

from omnimodel_operator import constants as C
from omnimodel_operator import naming
from omnimodel_operator.kube import Manifest
from omnimodel_operator.reconcile import Observed

# Index name (the kopf handler's function name) → kind of the objects it holds.
CHILD_INDEXES: Final[Mapping[str, str]] = {
    "configmaps": "ConfigMap",
    "services": "Service",
    "serviceaccounts": "ServiceAccount",
    "deployments": "Deployment",
    "horizontalpodautoscalers": "HorizontalPodAutoscaler",
    "poddisruptionbudgets": "PodDisruptionBudget",
    "networkpolicies": "NetworkPolicy",
    "jobs": "Job",
    "persistentvolumeclaims": "PersistentVolumeClaim",
}
# Kind → apiVersion, for objects whose watch events lack them (list items do).
_API_VERSIONS: Final[Mapping[str, str]] = {
    "ConfigMap": "v1",
    "Service": "v1",
    "ServiceAccount": "v1",
    "Pod": "v1",
    "Deployment": "apps/v1",
    "HorizontalPodAutoscaler": "autoscaling/v2",
    "PodDisruptionBudget": "policy/v1",
    "NetworkPolicy": "networking.k8s.io/v1",
    "Job": "batch/v1",
    "PersistentVolumeClaim": "v1",
}


def snapshot(body: Mapping[str, Any]) -> Manifest:
    """A private copy of a watched object: kopf's bodies are live views of the latest event."""
    return copy.deepcopy(dict(body))


def instance_of(name: str) -> str:
    return naming.instance_label(name)


def owner_of(body: Mapping[str, Any]) -> str | None:
    """The OmniModel that controls this object, if any (pods are owned by ReplicaSets: None)."""
    for ref in body["metadata"].get("ownerReferences") or []:
        if ref.get("controller") and ref.get("kind") == C.KIND:
            return str(ref["name"])
    return None


@dataclass(frozen=True)
class IndexCache:
    """:class:`~omnimodel_operator.controller.Cache` over kopf indexes."""

    omnimodels: Mapping[Any, Iterable[Manifest]]
    instances: Mapping[Any, Iterable[str]]
    children: Mapping[str, Mapping[Any, Iterable[Manifest]]]
    pods: Mapping[Any, Iterable[Manifest]]

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> IndexCache:
        """From the keyword arguments kopf passes a handler: one per index, named after its function."""
        return cls(
            omnimodels=kwargs["omnimodels"],
            instances=kwargs["omnimodel_instances"],
            children={name: kwargs[name] for name in CHILD_INDEXES},
            pods=kwargs["pods"],
        )

    def omnimodel(self, namespace: str, name: str) -> Manifest | None:
        return next(iter(self.omnimodels.get((namespace, name), ())), None)

    def omnimodel_keys(self) -> Iterator[tuple[str, str]]:
        return iter(list(self.omnimodels))

    def owners(self, namespace: str, instance: str) -> Iterable[str]:
        return list(self.instances.get((namespace, instance), ()))

    def observed(self, namespace: str, name: str) -> Observed:
        key = (namespace, instance_of(name))
        objects: dict[tuple[str, str], Manifest] = {}
        for index, kind in CHILD_INDEXES.items():
            for obj in self.children[index].get(key, ()):
                obj.setdefault("kind", kind)
                obj.setdefault("apiVersion", _API_VERSIONS[kind])
                objects[(kind, obj["metadata"]["name"])] = obj
        return Observed(objects=objects, pods=list(self.pods.get(key, ())))
