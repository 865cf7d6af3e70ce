"""Rendering an OmniModel on vLLM-Omni's own engines: every bundled deploy config, the acceptance CR, golden
files per config × vendor, and the specs that cannot work."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from omnimodel_operator.runtimes import render, resolve
from omnimodel_operator.settings import OperatorSettings
from omnimodel_operator.spec import InvalidSpec
from omnimodel_operator.vllm_omni import load_catalogue
from omnimodel_runtime.pipeline import parse_pipeline

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
    assert plan.plan.endpoint == "http://qwen3-omni-gateway.ml.svc:8000"


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


def test_a_cached_hub_model_is_fetched_once_and_every_pod_reads_it_offline() -> None:
    model = {
        "source": "hf://org/model",
        "revision": "v1",
        "endpoint": "http://mirror.ml:8090",
        "tokenSecret": {"name": "hf-token", "key": "token"},
        "cache": {"pvc": "weights"},
    }
    stages: list[dict[str, Any]] = [
        {"name": "talker", "replicas": 2},
        {"name": "code2wav", "accelerator": {"vendor": "cpu"}},
    ]
    plan = resolve("omni", "ml", {**spec("qwen2_5_omni", stages), "model": model}, SETTINGS, uid=UID)
    out = by_kind_name(render(plan, SETTINGS))
    jobs = [m for (kind, _), m in out.items() if kind == "Job"]
    assert len(jobs) == 1  # one fetch for the whole graph, not one download per pod
    (fetch,) = jobs[0]["spec"]["template"]["spec"]["containers"]
    # vLLM-Omni's image has no `omnimodel`: the fetch runs from the runtime image.
    assert fetch["image"] == SETTINGS.cpu_runtime_image and fetch["command"] == ["omnimodel", "fetch"]
    mentions = [f"{k}/{n}" for (k, n), m in out.items() if "hf-token" in json.dumps(m)]
    assert mentions == [f"Job/{jobs[0]['metadata']['name']}"]
    # What the fetch and the waits read: the whole repository under one stage, `model`.
    pipeline = parse_pipeline(out[("ConfigMap", "omni-pipeline")]["data"]["pipeline.json"])
    assert pipeline.model.source == "hf://org/model" and pipeline.model.revision == "v1"
    assert [(s.name, s.files) for s in pipeline.stages] == [("model", None)]
    shm = {"thinker": "2Gi", "talker": "2Gi", "code2wav": "1Gi"}
    for stage in ("thinker", "talker", "code2wav"):
        pod = out[("Deployment", f"omni-{stage}")]["spec"]["template"]["spec"]
        (init,) = pod["initContainers"]
        assert init["image"] == SETTINGS.cpu_runtime_image
        assert init["command"] == ["omnimodel", "wait-weights"] and init["args"][-2:] == ["--stage", "model"]
        assert "nvidia.com/gpu" not in json.dumps(init["resources"])  # the wait holds no device
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["model-cache"]["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
        assert {"key": "pipeline.json", "path": "pipeline.json"} in volumes["deploy"]["configMap"]["items"]
        assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": shm[stage]}
        engine = container(out[("Deployment", f"omni-{stage}")])
        env = {e["name"]: e.get("value") for e in engine["env"]}
        assert env["HF_HUB_OFFLINE"] == "1" and "HF_TOKEN" not in env and "HF_ENDPOINT" not in env
        assert env["HF_HOME"] == "/models/hf"  # the cache's hub layout, where the fetch put the files
        args = engine["args"]
        assert args[:2] == ["org/model", "--omni"] and args[args.index("--revision") + 1] == "v1"
        mount = next(m for m in engine["volumeMounts"] if m["name"] == "model-cache")
        assert mount["readOnly"] is True


def test_without_a_cache_each_vllm_omni_pod_downloads_from_the_mirror() -> None:
    model = {"source": "hf://org/model", "endpoint": "http://mirror.ml:8090"}
    out = by_kind_name(render(resolve("omni", "ml", {**spec("qwen2_5_omni"), "model": model}, SETTINGS), SETTINGS))
    assert not [k for k in out if k[0] in ("Job", "PersistentVolumeClaim")]
    assert "pipeline.json" not in out[("ConfigMap", "omni-pipeline")]["data"]
    talker = out[("Deployment", "omni-talker")]
    assert "initContainers" not in talker["spec"]["template"]["spec"]
    assert {"name": "model-cache", "emptyDir": {}} in talker["spec"]["template"]["spec"]["volumes"]
    env = {e["name"]: e.get("value") for e in container(talker)["env"]}
    assert env["HF_ENDPOINT"] == "http://mirror.ml:8090" and "HF_HUB_OFFLINE" not in env
    assert "--revision" not in container(talker)["args"]
