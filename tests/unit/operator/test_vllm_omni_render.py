"""Rendering an OmniModel on vLLM-Omni's own engines: every bundled deploy config, the acceptance CR, golden
files per config × vendor, and the specs that cannot work."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from omnimodel_operator.builders import render
from omnimodel_operator.resolve import InvalidSpec, resolve
from omnimodel_operator.settings import OperatorSettings
from omnimodel_operator.vllm_omni import load_catalogue

REPO = Path(__file__).parents[3]
GOLDEN = Path(__file__).parent / "golden" / "vllm-omni"
SETTINGS = OperatorSettings()
UID = "00000000-0000-0000-0000-000000000002"
CATALOGUE = load_catalogue()
SAME_HOST = {"SharedMemoryConnector", "MoriTransferEngineConnector"}


def spec(
    config: str | None, stages: list[dict[str, Any]] | None = None, source: str = "hf://org/model"
) -> dict[str, Any]:
    runtime: dict[str, Any] = {"kind": "vllm-omni"}
    if config:
        runtime["deployConfig"] = config
    return {"model": {"source": source}, "runtime": runtime, **({"stages": stages} if stages else {})}


def by_kind_name(manifests: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(m["kind"], m["metadata"]["name"]): m for m in manifests}


def container(deploy: dict[str, Any]) -> dict[str, Any]:
    containers: list[dict[str, Any]] = deploy["spec"]["template"]["spec"]["containers"]
    return containers[0]


@pytest.mark.parametrize("config", [c.name for c in CATALOGUE.configs])
def test_every_bundled_deploy_config_renders(config: str) -> None:
    entry = CATALOGUE.get(config)
    out = by_kind_name(render(resolve("m", "ml", spec(config), SETTINGS, uid=UID), SETTINGS))
    head = out[("Deployment", f"m-{entry.head_stage.name}")]
    assert "--headless" not in container(head)["args"]
    for stage in entry.stages:
        if stage.id != entry.head_stage.id:
            args = container(out[("Deployment", f"m-{stage.name}")])["args"]
            assert args[args.index("--stage-id") + 1] == str(stage.id)
            assert "--headless" in args
    deploy = yaml.safe_load(out[("ConfigMap", "m-pipeline")]["data"]["deploy.yaml"])
    assert [s["stage_id"] for s in deploy["stages"]] == [s.id for s in entry.stages]
    assert {s["devices"] for s in deploy["stages"]} <= {"0", "0,1", "0,1,2,3", "0,1,2,3,4,5,6,7"}
    # Pods are on different hosts: no edge may be left on a same-host-only connector.
    used = {
        n
        for s in deploy["stages"]
        for k in ("input_connectors", "output_connectors")
        for n in (s.get(k) or {}).values()
    }
    leftover = {n for n, c in (deploy.get("connectors") or {}).items() if n in used and c["name"] in SAME_HOST}
    assert not leftover, leftover
    assert (("Deployment", "m-mooncake") in out) == entry.same_host_only


def test_the_acceptance_cr_renders_its_resources_placements_and_command_lines() -> None:
    doc = yaml.safe_load((REPO / "examples" / "vllm-omni-qwen3-omni.yaml").read_text())
    plan = resolve(doc["metadata"]["name"], "ml", doc["spec"], SETTINGS, uid=UID)
    out = by_kind_name(render(plan, SETTINGS))
    thinker, talker, code2wav = (out[("Deployment", f"qwen3-omni-{s}")] for s in ("thinker", "talker", "code2wav"))
    # Requests and limits from the devices (the operator's defaults: 500m + 2 CPUs, 2Gi + 16Gi per device).
    assert container(thinker)["resources"] == {
        "limits": {"cpu": "18", "memory": "34Gi", "nvidia.com/gpu": "2"},
        "requests": {"cpu": "4500m", "memory": "34Gi"},
    }
    assert thinker["spec"]["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    talker_limits = {"amd.com/gpu": "1", "cpu": "10", "memory": "18Gi"}
    assert (talker["spec"]["replicas"], container(talker)["resources"]["limits"]) == (2, talker_limits)
    assert talker["spec"]["template"]["spec"]["nodeSelector"] == {"amd.com/gpu.product-name": "AMD_Instinct_MI300X"}
    assert code2wav["spec"]["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-L40S"}
    model, deploy_file = "Qwen/Qwen3-Omni-30B-A3B-Instruct", "/etc/omnimodel/deploy.yaml"
    assert container(thinker)["args"][:6] == [model, "--omni", "--deploy-config", deploy_file, "--stage-id", "0"]
    assert "$(POD_IP)" in container(thinker)["args"]
    args = container(talker)["args"]
    assert args[args.index("--omni-master-address") + 1] == "qwen3-omni-master.ml.svc"
    deploy = yaml.safe_load(out[("ConfigMap", "qwen3-omni-pipeline")]["data"]["deploy.yaml"])
    thinker_deploy = deploy["stages"][0]
    assert (thinker_deploy["devices"], thinker_deploy["tensor_parallel_size"]) == ("0,1", 2)
    master = out[("Service", "qwen3-omni-master")]["spec"]
    assert (master["clusterIP"], master["publishNotReadyAddresses"]) == ("None", True)
    assert out[("Service", "qwen3-omni-gateway")]["spec"]["selector"]["app.kubernetes.io/component"] == "head"
    assert plan.endpoint == "http://qwen3-omni-gateway.ml.svc:8000"


CASES = {
    "qwen2_5_omni-nvidia": spec("qwen2_5_omni"),
    "qwen2_5_omni-amd-ascend-cpu": spec(
        "qwen2_5_omni",
        [
            {"name": "thinker", "accelerator": {"vendor": "amd", "product": "MI300X", "count": 1}},
            {"name": "talker", "replicas": 2, "accelerator": {"vendor": "ascend", "product": "910B", "count": 1}},
            {"name": "code2wav", "accelerator": {"vendor": "cpu"}, "engineArgs": {"dtype": "float32"}},
        ],
    ),
    "single-stage-dit-cpu": spec(
        None, [{"name": "dit", "replicas": 2, "accelerator": {"vendor": "cpu"}}], source="file:///models/qwen-image"
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden(case: str) -> None:
    rendered = yaml.safe_dump_all(
        render(resolve("demo", "ml", CASES[case], SETTINGS, uid=UID), SETTINGS), sort_keys=True
    )
    path = GOLDEN / f"{case}.yaml"
    if os.environ.get("UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(rendered)
    assert path.exists(), f"missing golden file {path}; run with UPDATE_GOLDEN=1"
    assert rendered == path.read_text(), f"{path.name} changed; review and run with UPDATE_GOLDEN=1"


def test_without_a_deploy_config_the_single_stage_settings_travel_on_the_command_line() -> None:
    out = by_kind_name(render(resolve("img", "ml", CASES["single-stage-dit-cpu"], SETTINGS, uid=UID), SETTINGS))
    head, extra = out[("Deployment", "img-dit")], out[("Deployment", "img-dit-replicas")]
    assert extra["spec"]["replicas"] == 1  # two replicas of the stage: the head's own, and one more pod
    assert "--deploy-config" not in container(head)["args"]
    assert "--stage-overrides" not in container(head)["args"]  # nothing differs from vLLM-Omni's defaults
    tp2 = CASES["single-stage-dit-cpu"] | {
        "stages": [
            {"name": "dit", "accelerator": {"vendor": "nvidia", "count": 2}, "engineArgs": {"tensor_parallel_size": 2}}
        ]
    }
    args = container(
        by_kind_name(render(resolve("img", "ml", tp2, SETTINGS, uid=UID), SETTINGS))[("Deployment", "img-dit")]
    )["args"]
    assert yaml.safe_load(args[args.index("--stage-overrides") + 1]) == {
        "0": {"devices": "0,1", "tensor_parallel_size": 2}
    }


@pytest.mark.parametrize(
    ("stages", "source", "field", "words"),
    [
        ([{"name": "thinker", "accelerator": {"vendor": "nvidia", "count": 1},
           "engineArgs": {"tensor_parallel_size": 2}}],
         "hf://o/m", "spec.stages[thinker].accelerator.count", "needs 2 device(s) per replica"),
        ([{"name": "thinker", "replicas": 0}], "hf://o/m", "spec.stages[thinker].replicas", "head pod"),
        ([{"name": "thinker", "autoscaling": {"maxReplicas": 3}}], "hf://o/m",
         "spec.stages[thinker].autoscaling", "single pod"),
        ([{"name": "talker", "engineArgs": {"devices": "3"}}], "hf://o/m",
         "spec.stages[talker].engineArgs.devices", "operator"),
        ([{"name": "talkr"}], "hf://o/m", "spec", "has no stage 'talkr'"),
        ([{"name": "talker", "engine": "vllm"}], "hf://o/m", "spec", "fixes engine"),
        ([{"name": "talker", "autoscaling": {"minReplicas": 0, "maxReplicas": 2}}], "hf://o/m", "spec",
         "cannot scale to zero"),
        (None, "tiny://qwen2.5-omni", "spec.model.source", "file://"),
    ],
)  # fmt: skip
def test_specs_that_cannot_work_are_refused_naming_the_field(
    stages: list[dict[str, Any]] | None, source: str, field: str, words: str
) -> None:
    with pytest.raises(InvalidSpec) as info:
        resolve("m", "ml", spec("qwen2_5_omni", stages, source), SETTINGS, uid=UID)
    assert info.value.field == field, info.value
    assert words in info.value.message, info.value
