"""The reconcile against the in-memory API server: convergence, no-op passes, pruning, status.

Each pass reads what the controller's watch-fed cache would hold (``FakeKube.snapshot``), so request
counts here are what a pass costs the API server.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from omnimodel_operator import conditions as cond
from omnimodel_operator.kube import ApiError
from omnimodel_operator.reconcile import Outcome, reconcile
from omnimodel_operator.settings import OperatorSettings
from omnimodel_runtime.pipeline import parse_pipeline
from testkit.fake_kube import FakeKube

REPO = Path(__file__).parents[3]
SETTINGS = OperatorSettings()
CLOCK = iter(f"2026-01-01T00:{m:02d}:{s:02d}Z" for m in range(60) for s in range(60))


def now() -> str:
    return next(CLOCK)


def example(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((REPO / "examples" / name).read_text())
    doc["metadata"]["namespace"] = "ml"
    return doc


def body(kube: FakeKube, name: str) -> dict[str, Any]:
    obj = kube.find("OmniModel", name, "ml")
    assert obj is not None
    return copy.deepcopy(obj)


def ready(kube: FakeKube, name: str) -> dict[str, Any]:
    status = body(kube, name).get("status") or {}
    found = cond.find(status.get("conditions"), cond.READY)
    assert found is not None
    return dict(found)


async def run(kube: FakeKube, name: str) -> Outcome:
    return await reconcile(kube, body(kube, name), kube.snapshot(name), SETTINGS, now)


@pytest.fixture
def kube() -> FakeKube:
    return FakeKube()


async def test_first_reconcile_converges_and_second_writes_nothing(kube: FakeKube) -> None:
    kube.put(example("qwen-omni.yaml"))
    first = await run(kube, "qwen-omni")
    assert len(first.applied) == 13
    assert {d["metadata"]["name"] for d in kube.of_kind("Deployment")} == {
        "qwen-omni-thinker", "qwen-omni-talker", "qwen-omni-code2wav", "qwen-omni-gateway",
    }  # fmt: skip
    for obj in kube.objects.values():
        if obj["kind"] not in ("OmniModel", "Event"):
            assert obj["metadata"]["ownerReferences"][0]["uid"] == body(kube, "qwen-omni")["metadata"]["uid"]
    assert ready(kube, "qwen-omni")["status"] == "False"  # nothing is rolled out yet: never early

    requests = len(kube.requests)
    again = await run(kube, "qwen-omni")
    assert again.applied == [] and again.deleted == []
    assert kube.requests[requests:] == []  # not even a read: the cache answers everything


async def test_ready_only_when_every_deployment_is_available(kube: FakeKube) -> None:
    kube.put(example("qwen-omni.yaml"))
    await run(kube, "qwen-omni")
    kube.mark_rolled_out()
    await run(kube, "qwen-omni")
    status = body(kube, "qwen-omni")["status"]
    assert ready(kube, "qwen-omni")["status"] == "True"
    assert status["readyStages"] == "3/3"
    assert status["endpoint"] == "http://qwen-omni-gateway.ml.svc:8000"
    assert status["observedGeneration"] == 1
    assert {c["type"]: c["status"] for c in status["conditions"]} == {
        "Ready": "True", "Progressing": "False", "Degraded": "False",
    }  # fmt: skip
    stages = {s["name"]: s for s in status["stages"]}
    assert stages["thinker"]["accelerator"] == "2x nvidia H200"
    events = [o for o in kube.objects.values() if o["kind"] == "Event"]
    assert [e["reason"] for e in events].count("Ready") == 1

    # a status-only pass with nothing changed writes nothing and keeps lastTransitionTime
    before = ready(kube, "qwen-omni")["lastTransitionTime"]
    writes = len(kube.writes)
    await run(kube, "qwen-omni")
    assert kube.writes[writes:] == []
    assert ready(kube, "qwen-omni")["lastTransitionTime"] == before


async def test_spec_change_shows_progressing_with_the_stage_named(kube: FakeKube) -> None:
    kube.put(example("qwen-omni.yaml"))
    await run(kube, "qwen-omni")
    kube.mark_rolled_out()
    await run(kube, "qwen-omni")

    om = kube.find("OmniModel", "qwen-omni", "ml")
    assert om is not None
    om["spec"]["stages"][2]["engineArgs"] = {"steps": 8}
    om["metadata"]["generation"] = 2
    out = await run(kube, "qwen-omni")
    assert "Deployment ml/qwen-omni-code2wav" in out.applied
    assert "Deployment ml/qwen-omni-thinker" not in out.applied
    status = body(kube, "qwen-omni")["status"]
    progressing = cond.find(status["conditions"], cond.PROGRESSING)
    assert progressing is not None and progressing["status"] == "True"
    assert "code2wav" in progressing["message"] and "thinker" not in progressing["message"]
    assert ready(kube, "qwen-omni")["reason"] == cond.UPDATING


async def test_removing_a_stage_deletes_its_children(kube: FakeKube) -> None:
    doc = example("custom-graph.yaml")
    doc["spec"]["stages"].append(
        {
            "name": "extra",
            "kind": "ar",
            "engine": "transformers",
            "task": "text-generation",
            "inputs": ["generate"],
        }
    )
    kube.put(doc)
    await run(kube, "custom-chat")
    assert kube.find("Deployment", "custom-chat-extra") is not None

    om = kube.find("OmniModel", "custom-chat", "ml")
    assert om is not None
    om["spec"]["stages"].pop()
    out = await run(kube, "custom-chat")
    assert sorted(out.deleted) == [
        "Deployment ml/custom-chat-extra", "NetworkPolicy ml/custom-chat-extra", "Service ml/custom-chat-extra",
    ]  # fmt: skip
    assert kube.find("Deployment", "custom-chat-extra") is None
    assert kube.find("Deployment", "custom-chat-generate") is not None


async def test_invalid_spec_applies_and_deletes_nothing(kube: FakeKube) -> None:
    kube.put(example("qwen-omni.yaml"))
    await run(kube, "qwen-omni")
    children = {k: v for k, v in kube.objects.items() if k[1] not in ("OmniModel", "Event")}

    om = kube.find("OmniModel", "qwen-omni", "ml")
    assert om is not None
    om["spec"]["stages"][1]["accelerator"] = {"vendor": "amd", "count": 0}
    writes = len(kube.writes)
    out = await run(kube, "qwen-omni")
    assert out.invalid is not None
    assert [w[0] for w in kube.writes[writes:]] == ["status", "create"]  # status + one Warning event
    assert {k: v for k, v in kube.objects.items() if k[1] not in ("OmniModel", "Event")} == children
    r = ready(kube, "qwen-omni")
    assert (r["status"], r["reason"]) == ("False", "InvalidSpec")
    assert "spec.stages[talker].accelerator" in r["message"]
    warning = [o for o in kube.objects.values() if o["kind"] == "Event" and o["reason"] == "InvalidSpec"]
    assert len(warning) == 1 and warning[0]["type"] == "Warning"
    assert "spec.stages[talker].accelerator" in warning[0]["message"]

    writes = len(kube.writes)  # the same invalid spec again: no new event, no write
    await run(kube, "qwen-omni")
    assert kube.writes[writes:] == []


async def test_a_stage_on_a_vendor_without_an_image_is_refused_until_one_is_named(kube: FakeKube) -> None:
    kube.put(example("text-to-image-tiny.yaml"))  # its DiT runs on Ascend, which has no published image
    out = await run(kube, "image-tiny")
    assert out.invalid is not None and out.applied == []
    assert {k[1] for k in kube.objects} == {"OmniModel", "Event"}
    r = ready(kube, "image-tiny")
    assert (r["status"], r["reason"]) == ("False", "InvalidSpec")
    assert r["message"].startswith("spec.stages[denoise].accelerator.vendor: no runtime image for vendor ascend")
    assert "runtime.images.ascend" in r["message"]

    own = "registry.example.com/ml/omnimodel-runtime:cann"
    settings = OperatorSettings(runtime_images={"ascend": own})
    await reconcile(kube, body(kube, "image-tiny"), kube.snapshot("image-tiny"), settings, now)
    denoise = kube.find("Deployment", "image-tiny-denoise")
    assert denoise is not None
    assert denoise["spec"]["template"]["spec"]["containers"][0]["image"] == own
    assert ready(kube, "image-tiny")["reason"] != "InvalidSpec"


async def test_drift_is_repaired(kube: FakeKube) -> None:
    kube.put(example("text-tiny.yaml"))
    await run(kube, "text-tiny")

    def scale(deploy: dict[str, Any]) -> None:
        deploy["spec"]["replicas"] = 5

    kube.update_as("kubectl", "Deployment", "ml", "text-tiny-llm", scale)  # `kubectl scale`
    out = await run(kube, "text-tiny")
    assert out.applied == ["Deployment ml/text-tiny-llm"]
    fixed = kube.find("Deployment", "text-tiny-llm")
    assert fixed is not None and fixed["spec"]["replicas"] == 1
    assert (await run(kube, "text-tiny")).applied == []  # the field is ours again: no apply loop


async def test_a_deleted_child_is_recreated(kube: FakeKube) -> None:
    kube.put(example("text-tiny.yaml"))
    await run(kube, "text-tiny")
    kube.remove("apps/v1", "Deployment", "ml", "text-tiny-llm")
    out = await run(kube, "text-tiny")
    assert out.applied == ["Deployment ml/text-tiny-llm"]


async def test_a_refused_child_is_reported_and_the_others_converge(kube: FakeKube) -> None:
    doc = example("text-tiny.yaml")
    doc["spec"]["stages"] = [{"name": "llm", "disruption": {"minAvailable": "150%"}}]
    kube.put(doc)
    refusal = (
        'PodDisruptionBudget.policy "text-tiny-llm" is invalid: '
        'spec.minAvailable: Invalid value: "150%": must not be greater than 100%'
    )
    kube.refuse[("apply", "PodDisruptionBudget")] = ApiError(422, "Invalid", refusal)
    out = await run(kube, "text-tiny")
    assert out.errors == [f"PodDisruptionBudget ml/text-tiny-llm: {refusal}"]
    assert not out.transient
    assert kube.find("Deployment", "text-tiny-llm") is not None  # the rest of the graph still converges
    kube.mark_rolled_out()
    await run(kube, "text-tiny")
    r = ready(kube, "text-tiny")
    assert (r["status"], r["reason"]) == ("False", cond.RECONCILE_ERROR)
    assert "spec.minAvailable" in r["message"] and "PodDisruptionBudget ml/text-tiny-llm" in r["message"]
    del kube.refuse[("apply", "PodDisruptionBudget")]  # fixed (say, by an admission webhook change)
    await run(kube, "text-tiny")
    assert ready(kube, "text-tiny")["status"] == "True"


async def test_a_name_taken_by_another_owner_is_a_conflict_and_nothing_is_taken_over(kube: FakeKube) -> None:
    kube.put(example("text-tiny.yaml"))
    other = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": "text-tiny-llm",
            "namespace": "ml",
            "ownerReferences": [
                {
                    "apiVersion": "omnimodel.io/v1alpha1",
                    "kind": "OmniModel",
                    "name": "text",
                    "uid": "other",
                    "controller": True,
                }
            ],
        },
        "spec": {"ports": [{"port": 80}]},
    }
    kube.put(other)
    out = await run(kube, "text-tiny")
    assert out.applied == [] and out.deleted == []
    assert out.conflicts == ["Service ml/text-tiny-llm exists and it belongs to OmniModel text (uid other)"]
    r = ready(kube, "text-tiny")
    assert (r["status"], r["reason"]) == ("False", cond.NAME_CONFLICT)
    taken = kube.find("Service", "text-tiny-llm", "ml")
    assert taken is not None and taken["metadata"]["ownerReferences"][0]["uid"] == "other"
    assert taken["spec"] == {"ports": [{"port": 80}]}


async def test_unschedulable_stage_is_named_in_status(kube: FakeKube) -> None:
    kube.put(example("qwen-omni.yaml"))
    await run(kube, "qwen-omni")
    kube.mark_rolled_out()
    kube.set_status(
        "Deployment",
        "ml",
        "qwen-omni-thinker",
        {"observedGeneration": 1, "replicas": 2, "updatedReplicas": 2},
    )
    kube.put(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "qwen-omni-thinker-abc",
                "namespace": "ml",
                "labels": {
                    "app.kubernetes.io/instance": "qwen-omni",
                    "app.kubernetes.io/managed-by": "omnimodel-operator",
                    "app.kubernetes.io/component": "stage",
                    "omnimodel.io/stage": "thinker",
                },
            },
            "status": {
                "phase": "Pending",
                "conditions": [
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": "0/6 nodes are available: 6 Insufficient nvidia.com/gpu.",
                    }
                ],
            },
        }
    )
    await run(kube, "qwen-omni")
    r = ready(kube, "qwen-omni")
    assert (r["status"], r["reason"]) == ("False", "InsufficientCapacity")
    assert "thinker" in r["message"] and "Insufficient nvidia.com/gpu" in r["message"]
    status = body(kube, "qwen-omni")["status"]
    progressing = cond.find(status["conditions"], cond.PROGRESSING)
    assert progressing is not None and (progressing["status"], progressing["reason"]) == (
        "True",
        "InsufficientCapacity",
    )
    degraded = cond.find(status["conditions"], cond.DEGRADED)
    assert degraded is not None and degraded["status"] == "False"  # never had its pods: not lost capacity
    assert {s["name"]: s["message"] for s in status["stages"]}["thinker"].startswith("thinker: pods cannot")
    assert status["readyStages"] == "2/3"


async def test_transient_api_error_never_reports_ready(kube: FakeKube) -> None:
    kube.put(example("text-tiny.yaml"))
    kube.refuse[("apply", "Deployment")] = ApiError(503, "ServiceUnavailable", "etcd leader changed")
    out = await run(kube, "text-tiny")
    assert out.transient
    r = ready(kube, "text-tiny")
    assert (r["status"], r["reason"]) == ("False", cond.RECONCILE_ERROR)
    assert "etcd leader changed" in r["message"]
    del kube.refuse[("apply", "Deployment")]
    await run(kube, "text-tiny")  # the retry converges
    assert kube.find("Deployment", "text-tiny-llm") is not None


async def test_configmap_is_the_runtime_pipeline_file(kube: FakeKube) -> None:
    """Contract: what the operator writes is exactly what the runtime parses."""
    kube.put(example("qwen-omni.yaml"))
    await run(kube, "qwen-omni")
    cm = kube.find("ConfigMap", "qwen-omni-pipeline", "ml")
    assert cm is not None
    pipeline = parse_pipeline(cm["data"]["pipeline.json"])
    assert [s.name for s in pipeline.stages] == ["thinker", "talker", "code2wav"]
    assert pipeline.stage("talker").accelerator.vendor.value == "amd"
    assert pipeline.stage("thinker").endpoints == ("http://qwen-omni-thinker.ml.svc:8001",)
    assert pipeline.model.source == "hf://Qwen/Qwen2.5-Omni-7B"
