"""Fake accelerator nodes, built from the operator's own accelerator table.

Labels, taints and the extended-resource name come from
``omnimodel_operator.accelerators.ACCELERATORS`` so the fake fleet matches
what the operator schedules against *by construction*: if the table changes,
the nodes change with it.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = [
    "DEFAULT_FLEET",
    "KWOK_ANNOTATION",
    "FakeNode",
    "build_node",
    "build_nodes",
    "load_accelerators",
]

#: Annotation kwok is told to manage (``--manage-nodes-with-annotation-selector``).
KWOK_ANNOTATION = ("kwok.x-k8s.io/node", "fake")


class AcceleratorSpecLike(Protocol):
    """The part of ``omnimodel_operator.accelerators.AcceleratorSpec`` used here."""

    @property
    def resource_name(self) -> str | None: ...

    @property
    def product_label(self) -> str | None: ...

    def node_labels(self, product: str | None) -> Mapping[str, str]: ...

    def node_taints(self) -> Sequence[Mapping[str, Any]]: ...


@dataclass(frozen=True)
class FakeNode:
    """One fake node: which vendor/product, how many devices, how big."""

    name: str
    vendor: str
    product: str | None = None
    devices: int = 0
    cpu: str = "32"
    memory: str = "128Gi"
    pods: str = "110"
    ephemeral_storage: str = "1Ti"


#: The default fleet (DESIGN.md section 6). Host sizes are typical of real
#: 8-GPU servers; nothing in the test bed actually consumes them.
DEFAULT_FLEET: tuple[FakeNode, ...] = (
    FakeNode("h200-0", "nvidia", "H200", 8, cpu="192", memory="2Ti"),
    FakeNode("h200-1", "nvidia", "H200", 8, cpu="192", memory="2Ti"),
    FakeNode("l40s-0", "nvidia", "L40S", 4, cpu="64", memory="512Gi"),
    FakeNode("mi300x-0", "amd", "MI300X", 8, cpu="192", memory="2Ti"),
    FakeNode("ascend910b-0", "ascend", "910B", 8, cpu="192", memory="1536Gi"),
    FakeNode("cpu-0", "cpu", None, 0, cpu="32", memory="128Gi"),
    FakeNode("cpu-1", "cpu", None, 0, cpu="32", memory="128Gi"),
)


def load_accelerators() -> Mapping[Any, AcceleratorSpecLike]:
    """Import the operator's table lazily, so importing this package never needs it."""
    mod = importlib.import_module("omnimodel_operator.accelerators")
    table: Mapping[Any, AcceleratorSpecLike] = mod.ACCELERATORS
    return table


def build_node(
    node: FakeNode,
    accelerators: Mapping[Any, AcceleratorSpecLike],
    *,
    kubelet_version: str | None = None,
) -> dict[str, Any]:
    """The Node object to POST (status included: kwok's node-initialize keeps it).

    ``kubelet_version`` (e.g. the apiserver's ``v1.36.5``) replaces kwok's
    ``kwok-<version>`` placeholder in ``nodeInfo``, for tools that parse it.
    """
    try:
        spec = accelerators[node.vendor]
    except KeyError:
        raise ValueError(
            f"node {node.name}: vendor {node.vendor!r} not in the accelerator table ({sorted(accelerators)})"
        ) from None
    labels: dict[str, str] = {
        "kubernetes.io/hostname": node.name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "node.kubernetes.io/instance-type": "kwok-fake",
    }
    labels.update(spec.node_labels(node.product))
    resources: dict[str, str] = {
        "cpu": node.cpu,
        "memory": node.memory,
        "pods": node.pods,
        "ephemeral-storage": node.ephemeral_storage,
    }
    if node.devices:
        if spec.resource_name is None:
            raise ValueError(f"node {node.name}: vendor {node.vendor!r} has no device resource")
        resources[spec.resource_name] = str(node.devices)
    taints = [dict(t) for t in spec.node_taints()]
    obj: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": node.name,
            "labels": labels,
            "annotations": {KWOK_ANNOTATION[0]: KWOK_ANNOTATION[1]},
        },
        "spec": {"taints": taints} if taints else {},
        "status": {
            "capacity": dict(resources),
            "allocatable": dict(resources),
            "nodeInfo": {
                "architecture": "amd64",
                "operatingSystem": "linux",
                **({"kubeletVersion": kubelet_version} if kubelet_version else {}),
            },
        },
    }
    return obj


def build_nodes(
    fleet: Sequence[FakeNode] = DEFAULT_FLEET,
    accelerators: Mapping[Any, AcceleratorSpecLike] | None = None,
    *,
    kubelet_version: str | None = None,
) -> list[dict[str, Any]]:
    """Node objects for the whole fleet."""
    table = accelerators if accelerators is not None else load_accelerators()
    return [build_node(n, table, kubelet_version=kubelet_version) for n in fleet]
