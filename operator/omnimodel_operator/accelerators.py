"""The one table of accelerator vendors: device resources, node labels, taints, images, env.

Names come from each vendor's device plugin and node labeller:

- NVIDIA: k8s-device-plugin advertises ``nvidia.com/gpu``; GPU Feature Discovery labels nodes
  ``nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3`` and ``nvidia.com/gpu.present=true``. Managed GPU
  pools (GKE, AKS, the GPU operator's docs) taint nodes ``nvidia.com/gpu:NoSchedule``.
- AMD: ROCm k8s-device-plugin advertises ``amd.com/gpu``; the AMD node labeller sets
  ``amd.com/gpu.product-name`` (e.g. ``AMD_Instinct_MI300X``).
- Intel: intel-device-plugins' GPU plugin advertises ``gpu.intel.com/i915`` (``gpu.intel.com/xe``
  for the xe kernel driver); its NFD rules label ``gpu.intel.com/product`` (e.g. ``Max_1550``).
- Huawei Ascend: the Ascend device plugin advertises ``huawei.com/Ascend910`` and labels nodes
  ``accelerator=huawei-Ascend910``; the chip model sits in ``node.kubernetes.io/npu.chip.name``.
- CPU: no device resource; the stage simply runs on nodes without an accelerator taint.

Products are matched by node label. Users may write the short product ("H200", "MI300X"); the table
turns it into the labeller's value ("NVIDIA-H200", "AMD_Instinct_MI300X") so that both spellings select
the same nodes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from omnimodel_runtime.pipeline import AcceleratorRequest, Vendor


@dataclass(frozen=True)
class AcceleratorSpec:
    """Everything the operator needs to place and configure a stage on one vendor's devices."""

    vendor: Vendor
    # Extended resource the vendor's device plugin advertises; None for cpu.
    resource_name: str | None
    # Node label whose value names the product; None when the vendor has no product selection.
    product_label: str | None
    # Prefix the labeller puts before the short product name ("NVIDIA-" + "H200").
    product_prefix: str
    # Labels every node of this vendor carries (besides the product label).
    presence_labels: Mapping[str, str]
    # Suffix of the runtime image tag built for this vendor (docker/runtime.<variant>.Dockerfile).
    image_variant: str
    # Whether this project builds and publishes that image. Without a Dockerfile there is no image to
    # default to: the vendor's stages need one named (spec.runtime.image or the operator's runtime_images).
    has_runtime_image: bool
    # Value of OMNIMODEL_DEVICE inside the pod: the torch device family the runtime should use.
    torch_device: str
    # Extra env the engines need on this vendor.
    extra_env: Mapping[str, str] = field(default_factory=dict)

    def product_value(self, product: str) -> str:
        """The node-label value for ``product`` ("H200" → "NVIDIA-H200"; full values pass through)."""
        if not self.product_prefix or product.startswith(self.product_prefix):
            return product
        return self.product_prefix + product

    def node_selector(self, request: AcceleratorRequest) -> dict[str, str]:
        """Labels a node must carry to host a stage asking for ``request``."""
        # Without a product the device request alone picks the nodes: requiring presence labels
        # would strand pods on clusters that run the device plugin but no labeller.
        if self.product_label and request.product:
            return {self.product_label: self.product_value(request.product)}
        return {}

    def resources(self, request: AcceleratorRequest) -> dict[str, str]:
        """Device limits for one replica (devices are only ever set as limits; requests follow)."""
        if self.resource_name is None:
            return {}
        return {self.resource_name: str(request.count)}

    def tolerations(self) -> list[dict[str, Any]]:
        """Tolerate this vendor's accelerator taint so device stages can land on tainted pools."""
        return [{"key": t["key"], "operator": "Exists", "effect": t["effect"]} for t in self.node_taints()]

    def node_labels(self, product: str | None) -> dict[str, str]:
        """Labels a real node of this vendor/product carries (used to build test nodes, too)."""
        labels = dict(self.presence_labels)
        if self.product_label and product:
            labels[self.product_label] = self.product_value(product)
        return labels

    def node_taints(self) -> list[dict[str, str]]:
        """Taints accelerator pools usually carry, so that CPU work stays off them."""
        if self.resource_name is None:
            return []
        return [{"key": self.resource_name, "value": "present", "effect": "NoSchedule"}]

    def env(self) -> dict[str, str]:
        return {"OMNIMODEL_DEVICE": self.torch_device, **self.extra_env}


ACCELERATORS: Final[Mapping[Vendor, AcceleratorSpec]] = {
    Vendor.NVIDIA: AcceleratorSpec(
        vendor=Vendor.NVIDIA,
        resource_name="nvidia.com/gpu",
        product_label="nvidia.com/gpu.product",
        product_prefix="NVIDIA-",
        presence_labels={"nvidia.com/gpu.present": "true"},
        image_variant="cuda",
        has_runtime_image=True,
        torch_device="cuda",
    ),
    Vendor.AMD: AcceleratorSpec(
        vendor=Vendor.AMD,
        resource_name="amd.com/gpu",
        product_label="amd.com/gpu.product-name",
        product_prefix="AMD_Instinct_",
        presence_labels={"amd.com/gpu.present": "true"},
        image_variant="rocm",
        has_runtime_image=True,
        torch_device="cuda",  # ROCm torch exposes AMD GPUs through the cuda device API.
    ),
    Vendor.INTEL: AcceleratorSpec(
        vendor=Vendor.INTEL,
        resource_name="gpu.intel.com/i915",
        product_label="gpu.intel.com/product",
        product_prefix="",
        presence_labels={"intel.feature.node.kubernetes.io/gpu": "true"},
        image_variant="xpu",
        has_runtime_image=False,
        torch_device="xpu",
    ),
    Vendor.ASCEND: AcceleratorSpec(
        vendor=Vendor.ASCEND,
        resource_name="huawei.com/Ascend910",
        product_label="node.kubernetes.io/npu.chip.name",
        product_prefix="",
        presence_labels={"accelerator": "huawei-Ascend910"},
        image_variant="cann",
        has_runtime_image=False,
        torch_device="npu",
    ),
    Vendor.CPU: AcceleratorSpec(
        vendor=Vendor.CPU,
        resource_name=None,
        product_label=None,
        product_prefix="",
        presence_labels={},
        image_variant="cpu",
        has_runtime_image=True,
        torch_device="cpu",
        # Without a device, engines must not try CUDA (vLLM picks its platform from this).
        extra_env={"CUDA_VISIBLE_DEVICES": ""},
    ),
}


def accelerator_for(vendor: Vendor | str) -> AcceleratorSpec:
    return ACCELERATORS[Vendor(vendor)]
