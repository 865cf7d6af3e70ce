"""Runtime images per vendor: defaults only where an image is published, and a refused stage elsewhere."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from omnimodel_operator import __version__
from omnimodel_operator import conditions as cond
from omnimodel_operator import constants as C
from omnimodel_operator.accelerators import ACCELERATORS
from omnimodel_operator.resolve import Plan
from omnimodel_operator.runtimes import resolve
from omnimodel_operator.settings import DEFAULT_RUNTIME_IMAGES, OperatorSettings
from omnimodel_operator.spec import InvalidSpec
from omnimodel_operator.status import OmniModelStatus, invalid_status
from omnimodel_runtime.pipeline import Vendor

REPO = Path(__file__).parents[3]
UNPUBLISHED = [Vendor.INTEL, Vendor.ASCEND]
OWN_IMAGE = "registry.example.com/ml/omnimodel-runtime:0.1.0-own"


def spec_on(vendor: Vendor, **runtime: str) -> dict[str, Any]:
    """A one-stage text model whose stage runs on ``vendor``."""
    return {
        "model": {"source": "tiny://text"},
        "preset": "text",
        "stages": [{"name": "llm", "accelerator": {"vendor": vendor.value}}],
        **({"runtime": runtime} if runtime else {}),
    }


def plan_of(spec: dict[str, Any], settings: OperatorSettings) -> Plan:
    plan = resolve("demo", "ml", spec, settings).plan
    assert isinstance(plan, Plan)
    return plan


def test_published_images_are_those_with_a_dockerfile() -> None:
    for vendor, spec in ACCELERATORS.items():
        dockerfile = REPO / "docker" / f"runtime.{spec.image_variant}.Dockerfile"
        assert spec.has_runtime_image == dockerfile.is_file(), vendor


def test_defaults_name_only_published_images() -> None:
    repo, version = C.DEFAULT_RUNTIME_REPOSITORY, __version__
    published = {"nvidia": f"{repo}:{version}-cuda", "amd": f"{repo}:{version}-rocm", "cpu": f"{repo}:{version}-cpu"}
    assert published == DEFAULT_RUNTIME_IMAGES
    assert OperatorSettings().runtime_images == published


@pytest.mark.parametrize("vendor", UNPUBLISHED)
def test_a_stage_on_a_vendor_without_an_image_is_refused(vendor: Vendor) -> None:
    with pytest.raises(InvalidSpec) as caught:
        resolve("demo", "ml", spec_on(vendor), OperatorSettings())
    err = caught.value
    assert err.field == "spec.stages[llm].accelerator.vendor"
    assert f"no runtime image for vendor {vendor.value}" in err.message
    # The message says how to fix it: the operator's per-vendor image, or the CR's own.
    assert f"runtime.images.{vendor.value}" in err.message
    assert "OMNIMODEL_RUNTIME_IMAGES" in err.message
    assert "spec.runtime.image" in err.message


@pytest.mark.parametrize("vendor", UNPUBLISHED)
def test_the_refusal_is_the_ready_condition(vendor: Vendor) -> None:
    with pytest.raises(InvalidSpec) as caught:
        resolve("demo", "ml", spec_on(vendor), OperatorSettings())
    status = invalid_status(str(caught.value), OmniModelStatus(), 3, "2026-01-01T00:00:00Z")
    ready = next(c for c in status.conditions or () if c.type == cond.READY)
    assert (ready.status, ready.reason, ready.observed_generation) == ("False", cond.INVALID_SPEC, 3)
    assert ready.message.startswith(f"spec.stages[llm].accelerator.vendor: no runtime image for vendor {vendor.value}")


@pytest.mark.parametrize("vendor", UNPUBLISHED)
def test_the_operator_setting_names_the_image(vendor: Vendor) -> None:
    # A partial map (what OMNIMODEL_RUNTIME_IMAGES may hold): the vendors it leaves out keep their defaults.
    settings = OperatorSettings(runtime_images={vendor.value: OWN_IMAGE})
    plan = plan_of(spec_on(vendor), settings)
    assert [s.image for s in plan.stages] == [OWN_IMAGE]
    assert plan.gateway_image == DEFAULT_RUNTIME_IMAGES["cpu"]


@pytest.mark.parametrize("vendor", UNPUBLISHED)
def test_the_cr_names_the_image(vendor: Vendor) -> None:
    plan = plan_of(spec_on(vendor, image=OWN_IMAGE), OperatorSettings())
    assert [s.image for s in plan.stages] == [OWN_IMAGE]
    assert plan.gateway_image == OWN_IMAGE


@pytest.mark.parametrize("vendor", [v for v, s in ACCELERATORS.items() if s.has_runtime_image])
def test_published_vendors_need_nothing_set(vendor: Vendor) -> None:
    plan = plan_of(spec_on(vendor), OperatorSettings())
    assert [s.image for s in plan.stages] == [DEFAULT_RUNTIME_IMAGES[vendor.value]]
