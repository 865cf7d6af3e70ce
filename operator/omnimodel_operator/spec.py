"""What every planner shares: the spec parsed, its errors named by field, an accelerator as a request.

Below both planners (:mod:`~omnimodel_operator.resolve` for this project's runtime and
:mod:`~omnimodel_operator.vllm_omni.plan` for vLLM-Omni's), so that neither imports the other's module to
reach them: ``resolve`` dispatches to the vLLM-Omni planner, which builds on these.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from omnimodel_operator.api.v1alpha1 import Accelerator, OmniModelSpec
from omnimodel_runtime.pipeline import AcceleratorRequest, Vendor


class InvalidSpec(ValueError):
    """The OmniModel cannot be rendered; ``field`` is the path of the offending field."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


def parse_spec(spec: Mapping[str, Any]) -> OmniModelSpec:
    """Validate a raw ``spec`` dict; errors name the first offending field (``spec.stages[0].replicas``)."""
    try:
        return OmniModelSpec.model_validate(spec)
    except ValidationError as err:
        first = err.errors()[0]
        path = "spec" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"])
        raise InvalidSpec(path, first["msg"].removeprefix("Value error, ")) from None


def accelerator_request(acc: Accelerator) -> AcceleratorRequest:
    count = acc.count if acc.count is not None else (0 if acc.vendor is Vendor.CPU else 1)
    try:
        return AcceleratorRequest(vendor=acc.vendor, product=acc.product, count=count)
    except ValidationError as err:
        raise InvalidSpec("accelerator", err.errors()[0]["msg"].removeprefix("Value error, ")) from None
