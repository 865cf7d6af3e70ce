"""The kinds of object an OmniModel owns: one table that drives the kopf watches (handlers), the cache's
indexes, what pruning may delete (builders), and the RBAC the chart grants (tests/component/chart checks
the chart's rules against it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final


@dataclass(frozen=True)
class ChildKind:
    api_version: str
    kind: str
    plural: str

    @property
    def group(self) -> str:
        """The API group ("" for the core group), as RBAC rules name it."""
        return self.api_version.rpartition("/")[0]

    @property
    def index(self) -> str:
        """The name of its kopf index, and so of the keyword argument kopf passes handlers."""
        return self.plural


# Kinds the operator creates and prunes, in no particular order; everything watched with our labels.
CHILD_KINDS: Final[tuple[ChildKind, ...]] = (
    ChildKind("v1", "ConfigMap", "configmaps"),
    ChildKind("v1", "Service", "services"),
    ChildKind("v1", "ServiceAccount", "serviceaccounts"),
    ChildKind("apps/v1", "Deployment", "deployments"),
    ChildKind("autoscaling/v2", "HorizontalPodAutoscaler", "horizontalpodautoscalers"),
    ChildKind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets"),
    ChildKind("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies"),
    ChildKind("batch/v1", "Job", "jobs"),
    ChildKind("v1", "PersistentVolumeClaim", "persistentvolumeclaims"),
)
# Watched (pods of our Deployments and Jobs carry our labels) but never created or pruned.
POD: Final = ChildKind("v1", "Pod", "pods")
