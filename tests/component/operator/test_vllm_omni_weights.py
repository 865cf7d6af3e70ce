"""A vLLM-Omni OmniModel with a cached hf:// model: the fetch Job is reconciled like the omnimodel
runtime's, and status waits for the weights before it can say Ready."""

from __future__ import annotations

from typing import Any

from omnimodel_operator import conditions as cond
from omnimodel_operator.reconcile import reconcile
from omnimodel_operator.settings import OperatorSettings
from testkit.fake_kube import FakeKube

SETTINGS = OperatorSettings()


def omnimodel() -> dict[str, Any]:
    return {
        "apiVersion": "omnimodel.io/v1alpha1",
        "kind": "OmniModel",
        "metadata": {"name": "img", "namespace": "ml", "generation": 1},
        "spec": {
            "model": {"source": "hf://org/tiny-image", "cache": {"pvc": "weights"}},
            "runtime": {"kind": "vllm-omni"},
            "stages": [{"name": "dit", "replicas": 2, "accelerator": {"vendor": "cpu"}}],
        },
    }


def conditions(kube: FakeKube) -> dict[str, tuple[str, str]]:
    body = kube.find("OmniModel", "img", "ml")
    assert body is not None
    return {c["type"]: (c["status"], c["reason"]) for c in (body.get("status") or {}).get("conditions") or []}


async def test_the_fetch_job_is_applied_and_ready_waits_for_the_weights() -> None:
    kube = FakeKube()
    kube.put(omnimodel())
    body = kube.find("OmniModel", "img", "ml")
    assert body is not None
    await reconcile(kube, body, kube.snapshot("img"), SETTINGS, lambda: "2026-01-01T00:00:00Z")
    (job,) = kube.of_kind("Job")
    assert job["metadata"]["name"].startswith("img-fetch-")
    got = conditions(kube)
    assert got[cond.WEIGHTS_READY] == ("False", "Pending")
    assert got[cond.READY] == ("False", cond.FETCHING_WEIGHTS)
