"""A vLLM-Omni OmniModel with a cached hf:// model: the fetch Job is reconciled like the omnimodel
runtime's, and status waits for the weights before it can say Ready."""

from __future__ import annotations

from typing import Any

import pytest

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


def memory_of(kube: FakeKube, deployment: str) -> tuple[str, str]:
    found = kube.find("Deployment", deployment, "ml")
    assert found is not None
    (container,) = found["spec"]["template"]["spec"]["containers"]
    return container["resources"]["requests"]["memory"], container["resources"]["limits"]["memory"]


async def test_cpu_stages_request_the_memory_the_fetch_reported_and_keep_it_after_its_pod_is_gone() -> None:
    kube = FakeKube()
    kube.put(omnimodel())

    async def reconcile_once() -> dict[str, Any]:
        body = kube.find("OmniModel", "img", "ml")
        assert body is not None
        await reconcile(kube, body, kube.snapshot("img"), SETTINGS, lambda: "2026-01-01T00:00:00Z")
        after = kube.find("OmniModel", "img", "ml")
        assert after is not None
        return dict(after.get("status") or {})

    await reconcile_once()
    (job,) = kube.of_kind("Job")
    assert memory_of(kube, "img-dit") == ("2Gi", "2Gi")  # the operator's default, size unknown
    # The fetch completes: 6 GiB of weights, which every vLLM-Omni stage opens (one file set, "model").
    size = 6 * 2**30
    line = f"Complete: org/tiny-image@{'a' * 40}: 3 files, {size} bytes, 0 bytes downloaded; stage bytes: model={size}"
    name = job["metadata"]["name"]
    labels = {**job["spec"]["template"]["metadata"]["labels"], "batch.kubernetes.io/job-name": name}
    kube.put(
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{name}-x", "namespace": "ml", "labels": labels}}
    )
    done = {"exitCode": 0, "message": line, "finishedAt": "2026-01-01T00:00:00Z"}
    kube.set_status("Pod", "ml", f"{name}-x", {"phase": "Succeeded", "containerStatuses": [
        {"name": "fetch", "state": {"terminated": done}}
    ]})  # fmt: skip
    kube.set_status("Job", "ml", name, {"conditions": [{"type": "Complete", "status": "True"}]})
    status = await reconcile_once()
    assert status["weights"]["stageBytes"] == {"model": 6 * 2**30}
    await reconcile_once()  # the pass after the status that told the size
    assert memory_of(kube, "img-dit") == ("7Gi", "7Gi")  # the weights plus 1Gi, limited at its request
    # The fetch pod garbage-collected: the size stays, so the stage does not roll back and forth.
    kube.remove("v1", "Pod", "ml", f"{name}-x")
    status = await reconcile_once()
    assert status["weights"]["stageBytes"] == {"model": 6 * 2**30}
    assert memory_of(kube, "img-dit") == ("7Gi", "7Gi")


@pytest.mark.parametrize(("resources", "memory"), [(None, "7Gi"), ({"requests": {"memory": "3Gi"}}, "3Gi")])
async def test_a_cpu_stage_is_sized_by_the_fetch_unless_it_sets_its_memory(
    resources: dict[str, Any] | None, memory: str
) -> None:
    kube = FakeKube()
    manifest = omnimodel()
    if resources:
        manifest["spec"]["stages"][0]["resources"] = resources
    kube.put(manifest)
    for _ in range(2):
        body = kube.find("OmniModel", "img", "ml")
        assert body is not None
        await reconcile(kube, body, kube.snapshot("img"), SETTINGS, lambda: "2026-01-01T00:00:00Z")
        (job,) = kube.of_kind("Job")
        weights = {"state": "Fetching", "job": job["metadata"]["name"], "stageBytes": {"model": 6 * 2**30}}
        kube.set_status("OmniModel", "ml", "img", {"weights": weights})
    assert memory_of(kube, "img-dit") == (memory, memory)
