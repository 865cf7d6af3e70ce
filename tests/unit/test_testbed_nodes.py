"""The fake fleet must look to the scheduler exactly like the operator's accelerator table says."""

from __future__ import annotations

from typing import Any

import pytest

from omnimodel_operator.accelerators import ACCELERATORS
from omnimodel_runtime.pipeline import Vendor
from omnimodel_testbed.nodes import DEFAULT_FLEET, KWOK_ANNOTATION, FakeNode, build_node, build_nodes


def _by_name() -> dict[str, dict[str, Any]]:
    return {n["metadata"]["name"]: n for n in build_nodes(DEFAULT_FLEET, ACCELERATORS)}


def test_fleet_has_the_documented_mix() -> None:
    vendors = sorted((n.vendor, n.product or "", n.devices) for n in DEFAULT_FLEET)
    assert vendors == [
        ("amd", "MI300X", 8),
        ("ascend", "910B", 8),
        ("cpu", "", 0),
        ("cpu", "", 0),
        ("nvidia", "H200", 8),
        ("nvidia", "H200", 8),
        ("nvidia", "L40S", 4),
    ]


@pytest.mark.parametrize("node", DEFAULT_FLEET, ids=lambda n: n.name)
def test_node_matches_accelerator_table(node: FakeNode) -> None:
    spec = ACCELERATORS[Vendor(node.vendor)]
    obj = _by_name()[node.name]
    labels = obj["metadata"]["labels"]
    # Every label the operator may select on is present with the table's value.
    for key, value in spec.node_labels(node.product).items():
        assert labels[key] == value
    assert obj["spec"].get("taints", []) == spec.node_taints()
    assert obj["metadata"]["annotations"] == {KWOK_ANNOTATION[0]: KWOK_ANNOTATION[1]}
    capacity = obj["status"]["capacity"]
    assert capacity == obj["status"]["allocatable"]
    if spec.resource_name is None:
        assert set(capacity) == {"cpu", "memory", "pods", "ephemeral-storage"}
    else:
        assert capacity[spec.resource_name] == str(node.devices)


def test_h200_nodes_are_selectable_by_short_and_full_product_name() -> None:
    nvidia = ACCELERATORS[Vendor.NVIDIA]
    h200 = [
        n["metadata"]["name"]
        for n in _by_name().values()
        if n["metadata"]["labels"].get(nvidia.product_label or "") == nvidia.product_value("H200")
    ]
    assert sorted(h200) == ["h200-0", "h200-1"]
    assert nvidia.product_value("H200") == nvidia.product_value("NVIDIA-H200")


def test_cpu_nodes_are_untainted_and_deviceless() -> None:
    nodes = _by_name()
    for name in ("cpu-0", "cpu-1"):
        assert "taints" not in nodes[name]["spec"]


def test_unknown_vendor_is_rejected() -> None:
    with pytest.raises(ValueError, match="not in the accelerator table"):
        build_node(FakeNode("x", "tpu", "v5e", 4), ACCELERATORS)


def test_devices_on_a_deviceless_vendor_are_rejected() -> None:
    with pytest.raises(ValueError, match="no device resource"):
        build_node(FakeNode("x", "cpu", None, 2), ACCELERATORS)
