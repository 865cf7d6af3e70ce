"""The controller's read side over kopf indexes: OmniModels, their children and pods, as last watched.

Every index is keyed by ``(namespace, instance label)`` (children) or ``(namespace, name)``
(OmniModels); the values are deep copies of the objects as of their last watch event, so nothing here
changes under a running reconcile.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from omnimodel_operator import constants as C
from omnimodel_operator import naming
from omnimodel_operator.kinds import CHILD_KINDS, POD
from omnimodel_operator.kube import Manifest
from omnimodel_operator.observed import Observed


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
            children={k.index: kwargs[k.index] for k in CHILD_KINDS},
            pods=kwargs[POD.index],
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
        for child in CHILD_KINDS:
            for obj in self.children[child.index].get(key, ()):
                # Watch events may lack kind and apiVersion (list items have them).
                obj.setdefault("kind", child.kind)
                obj.setdefault("apiVersion", child.api_version)
                objects[(child.kind, obj["metadata"]["name"])] = obj
        return Observed(objects=objects, pods=list(self.pods.get(key, ())))
