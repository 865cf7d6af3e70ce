"""The accelerator table: what each vendor's stage gets, and what its nodes carry."""

from __future__ import annotations

import pytest

from omnimodel_operator.accelerators import ACCELERATORS, accelerator_for
from omnimodel_runtime.pipeline import AcceleratorRequest, Vendor


@pytest.mark.parametrize(
    ("vendor", "resource", "label", "product", "label_value"),
    [
        (Vendor.NVIDIA, "nvidia.com/gpu", "nvidia.com/gpu.product", "H200", "NVIDIA-H200"),
        (Vendor.AMD, "amd.com/gpu", "amd.com/gpu.product-name", "MI300X", "AMD_Instinct_MI300X"),
        (Vendor.INTEL, "gpu.intel.com/i915", "gpu.intel.com/product", "Max_1550", "Max_1550"),
        (Vendor.ASCEND, "huawei.com/Ascend910", "node.kubernetes.io/npu.chip.name", "910B", "910B"),
    ],
)
def test_device_vendors(vendor: Vendor, resource: str, label: str, product: str, label_value: str) -> None:
    spec = accelerator_for(vendor)
    request = AcceleratorRequest(vendor=vendor, product=product, count=2)
    assert spec.resources(request) == {resource: "2"}
    assert spec.node_selector(request) == {label: label_value}
    # the labeller's full value is accepted as-is, so both spellings select the same nodes
    assert spec.node_selector(request.model_copy(update={"product": label_value})) == {label: label_value}
    # a stage tolerates exactly the taint that this vendor's nodes carry
    taint = spec.node_taints()[0]
    assert {"key": taint["key"], "operator": "Exists", "effect": taint["effect"]} in spec.tolerations()
    assert spec.node_labels(product)[label] == label_value


def test_without_product_the_device_request_alone_places_the_pod() -> None:
    spec = accelerator_for("nvidia")
    assert spec.node_selector(AcceleratorRequest(vendor=Vendor.NVIDIA, count=1)) == {}


def test_cpu_has_no_device_no_taint_and_hides_cuda() -> None:
    spec = accelerator_for(Vendor.CPU)
    request = AcceleratorRequest()
    assert spec.resources(request) == {}
    assert spec.node_selector(request) == {}
    assert spec.tolerations() == []
    assert spec.env() == {"OMNIMODEL_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": ""}


def test_every_vendor_has_a_distinct_image_variant() -> None:
    variants = [spec.image_variant for spec in ACCELERATORS.values()]
    assert sorted(variants) == sorted(set(variants))
    assert set(ACCELERATORS) == set(Vendor)
