"""Builders: golden manifests per preset × vendor, and the acceptance render of the omni example."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from omnimodel_operator.runtimes import render, resolve
from omnimodel_operator.settings import DEFAULT_RUNTIME_IMAGES, OperatorSettings
from omnimodel_runtime.pipeline import PRESETS, Vendor

GOLDEN = Path(__file__).parent / "golden"
REPO = Path(__file__).parents[3]
PRODUCTS = {Vendor.NVIDIA: "H200", Vendor.AMD: "MI300X", Vendor.INTEL: "Max_1550", Vendor.ASCEND: "910B"}
# Intel and Ascend have no published runtime image: the operator is told one, as a cluster with them must be.
SETTINGS = OperatorSettings(
    runtime_images={
        **DEFAULT_RUNTIME_IMAGES,
        "intel": "registry.example.com/ml/omnimodel-runtime:xpu",
        "ascend": "registry.example.com/ml/omnimodel-runtime:cann",
    }
)


def spec_for(preset: str, vendor: Vendor) -> dict[str, Any]:
    accelerator: dict[str, Any] = {"vendor": vendor.value}
    if vendor is not Vendor.CPU:
        accelerator |= {"product": PRODUCTS[vendor], "count": 1}
    return {
        "model": {"source": f"tiny://{preset}"},
        "preset": preset,
        "stages": [{"name": s, "accelerator": accelerator} for s in PRESETS[preset].stage_names],
    }


@pytest.mark.parametrize("vendor", list(Vendor))
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_golden(preset: str, vendor: Vendor) -> None:
    plan = resolve("demo", "ml", spec_for(preset, vendor), SETTINGS, uid="00000000-0000-0000-0000-000000000001")
    rendered = yaml.safe_dump_all(render(plan, SETTINGS), sort_keys=True)
    path = GOLDEN / f"{preset}-{vendor.value}.yaml"
    if os.environ.get("UPDATE_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(rendered)
    assert path.exists(), f"missing golden file {path}; run with UPDATE_GOLDEN=1"
    assert rendered == path.read_text(), f"{path.name} changed; review and run with UPDATE_GOLDEN=1"


def by_kind_name(manifests: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(m["kind"], m["metadata"]["name"]): m for m in manifests}


def container(deploy: dict[str, Any]) -> dict[str, Any]:
    containers: list[dict[str, Any]] = deploy["spec"]["template"]["spec"]["containers"]
    return containers[0]


def test_qwen_omni_example_renders_heterogeneous_stages() -> None:
    doc = yaml.safe_load((REPO / "examples" / "qwen-omni.yaml").read_text())
    plan = resolve(doc["metadata"]["name"], "ml", doc["spec"], SETTINGS, uid="u")
    out = by_kind_name(render(plan, SETTINGS))

    thinker = out[("Deployment", "qwen-omni-thinker")]
    # Two GPUs: the process's share plus two devices' worth of CPU and host memory.
    assert container(thinker)["resources"] == {
        "limits": {"cpu": "18", "memory": "34Gi", "nvidia.com/gpu": "2"},
        "requests": {"cpu": "4500m", "memory": "34Gi"},
    }
    assert thinker["spec"]["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    assert thinker["spec"]["replicas"] == 2
    assert container(thinker)["image"].endswith("-cuda")

    talker = out[("Deployment", "qwen-omni-talker")]
    assert container(talker)["resources"]["limits"] == {"amd.com/gpu": "1", "cpu": "10", "memory": "18Gi"}
    assert "replicas" not in talker["spec"]  # the operator's autoscaler owns it (scale subresource)
    assert ("HorizontalPodAutoscaler", "qwen-omni-talker") not in out  # provider operator: no HPA

    code2wav = out[("Deployment", "qwen-omni-code2wav")]
    # The example's own requests, limited by the shipped ratios (CPU 4x, memory 1x); no device.
    assert container(code2wav)["resources"] == {
        "limits": {"cpu": "8", "memory": "4Gi"},
        "requests": {"cpu": "2", "memory": "4Gi"},
    }
    assert "tolerations" not in code2wav["spec"]["template"]["spec"]

    assert out[("Deployment", "qwen-omni-gateway")]["spec"]["replicas"] == 2
    for name in ("thinker", "talker", "code2wav", "gateway"):
        assert ("Service", f"qwen-omni-{name}") in out
    assert ("ConfigMap", "qwen-omni-pipeline") in out


def test_stage_container_runs_the_runtime_stage_command() -> None:
    plan = resolve("m", "ml", spec_for("tts", Vendor.CPU), SETTINGS, uid="u")
    deploy = by_kind_name(render(plan, SETTINGS))[("Deployment", "m-vocoder")]
    c = container(deploy)
    assert c["command"] + c["args"][:4] == [
        "omnimodel", "stage", "--pipeline", "/etc/omnimodel/pipeline.json", "--stage", "vocoder",
    ]  # fmt: skip
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    pod = deploy["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
    assert c["startupProbe"]["httpGet"]["path"] == "/health"


def test_user_overrides_merge_with_accelerator_placement() -> None:
    spec = spec_for("text", Vendor.NVIDIA)
    spec["stages"][0] |= {
        "nodeSelector": {"pool": "a"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}],
        "env": [{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}],
        "resources": {"requests": {"cpu": "4", "memory": "32Gi"}},
    }
    deploy = by_kind_name(render(resolve("m", "ml", spec, SETTINGS, uid="u"), SETTINGS))[("Deployment", "m-llm")]
    pod = deploy["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200", "pool": "a"}
    assert [t["key"] for t in pod["tolerations"]] == ["nvidia.com/gpu", "dedicated"]
    c = container(deploy)
    assert {"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"} in c["env"]
    assert c["resources"] == {
        "limits": {"cpu": "16", "memory": "32Gi", "nvidia.com/gpu": "1"},
        "requests": {"cpu": "4", "memory": "32Gi"},
    }


def test_changing_one_stage_rolls_only_that_stage() -> None:
    spec = spec_for("qwen2.5-omni", Vendor.CPU)
    before = by_kind_name(render(resolve("m", "ml", spec, SETTINGS, uid="u"), SETTINGS))
    spec["stages"][1]["engineArgs"] = {"temperature": 0.5}
    after = by_kind_name(render(resolve("m", "ml", spec, SETTINGS, uid="u"), SETTINGS))

    def template(out: dict[tuple[str, str], dict[str, Any]], name: str) -> Any:
        return out[("Deployment", name)]["spec"]["template"]

    assert template(before, "m-thinker") == template(after, "m-thinker")
    assert template(before, "m-talker") != template(after, "m-talker")
    assert template(before, "m-gateway") != template(after, "m-gateway")


def test_network_policy_admits_only_the_gateway_unless_scraping_is_enabled() -> None:
    """The gateway relays every hand-off, so no stage needs to reach another one."""
    plan = resolve("m", "ml", spec_for("qwen2.5-omni", Vendor.CPU), SETTINGS, uid="u")
    for stage in ("thinker", "talker", "code2wav"):
        peers = by_kind_name(render(plan, SETTINGS))[("NetworkPolicy", f"m-{stage}")]["spec"]["ingress"][0]["from"]
        assert peers == [
            {
                "podSelector": {
                    "matchLabels": {"app.kubernetes.io/instance": "m", "app.kubernetes.io/component": "gateway"}
                }
            }
        ]
    monitoring = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    scraped = OperatorSettings(scrape_from=monitoring)
    peers = by_kind_name(render(plan, scraped))[("NetworkPolicy", "m-talker")]["spec"]["ingress"][0]["from"]
    assert peers[1] == monitoring


def test_runtime_pods_run_as_their_own_service_account_without_a_token() -> None:
    out = by_kind_name(render(resolve("m", "ml", spec_for("qwen2.5-omni", Vendor.CPU), SETTINGS, uid="u"), SETTINGS))
    assert out[("ServiceAccount", "m-runtime")]["automountServiceAccountToken"] is False
    for name in ("m-thinker", "m-talker", "m-code2wav", "m-gateway"):
        pod = out[("Deployment", name)]["spec"]["template"]["spec"]
        assert (pod["serviceAccountName"], pod["automountServiceAccountToken"]) == ("m-runtime", False)


def test_every_container_gets_requests_and_limits_from_its_stage() -> None:
    """A namespace whose ResourceQuota requires limits.cpu and limits.memory admits a pod only when every
    container, init containers included, sets them; the defaults follow the stage's devices."""
    spec = spec_for("text", Vendor.NVIDIA) | {"model": {"source": "hf://org/llm", "cache": {"pvc": "models"}}}
    out = by_kind_name(render(resolve("m", "ml", spec, SETTINGS, uid="u"), SETTINGS))
    pod = out[("Deployment", "m-llm")]["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"] == {
        "limits": {"cpu": "10", "memory": "18Gi", "nvidia.com/gpu": "1"},
        "requests": {"cpu": "2500m", "memory": "18Gi"},
    }
    # The wait for the weights runs before the stage: its CPU and memory, never its device.
    assert pod["initContainers"][0]["resources"] == {
        "limits": {"cpu": "10", "memory": "18Gi"},
        "requests": {"cpu": "2500m", "memory": "18Gi"},
    }
    assert container(out[("Deployment", "m-gateway")])["resources"] == {
        "limits": {"cpu": "1", "memory": "512Mi"},
        "requests": {"cpu": "250m", "memory": "512Mi"},
    }
    fetch = out[next(k for k in out if k[0] == "Job")]["spec"]["template"]["spec"]["containers"][0]
    assert fetch["resources"] == {"limits": {"cpu": "2", "memory": "1Gi"}, "requests": {"cpu": "500m", "memory": "1Gi"}}
    cpu = by_kind_name(render(resolve("m", "ml", spec_for("text", Vendor.CPU), SETTINGS, uid="u"), SETTINGS))
    assert container(cpu[("Deployment", "m-llm")])["resources"] == {
        "limits": {"cpu": "2", "memory": "2Gi"},
        "requests": {"cpu": "500m", "memory": "2Gi"},
    }


@pytest.mark.parametrize(
    ("own", "expected"),
    [
        # A request alone: the other resource keeps its default, each limit follows its request.
        (
            {"requests": {"cpu": "8"}},
            {
                "limits": {"cpu": "32", "memory": "18Gi", "nvidia.com/gpu": "1"},
                "requests": {"cpu": "8", "memory": "18Gi"},
            },
        ),
        # A limit alone: no default request under it (Kubernetes requests the limit).
        (
            {"limits": {"memory": "64Gi"}},
            {"limits": {"cpu": "10", "memory": "64Gi", "nvidia.com/gpu": "1"}, "requests": {"cpu": "2500m"}},
        ),
        # Both: the spec's, as written; the device limit is the accelerator table's.
        (
            {"requests": {"cpu": "1", "memory": "3G"}, "limits": {"cpu": "1", "memory": "3G", "nvidia.com/gpu": "4"}},
            {"limits": {"cpu": "1", "memory": "3G", "nvidia.com/gpu": "1"}, "requests": {"cpu": "1", "memory": "3G"}},
        ),
    ],
)
def test_a_stages_own_resources_override_the_defaults_per_resource(own: dict[str, Any], expected: Any) -> None:
    spec = spec_for("text", Vendor.NVIDIA)
    spec["stages"][0]["resources"] = own
    out = by_kind_name(render(resolve("m", "ml", spec, SETTINGS, uid="u"), SETTINGS))
    assert container(out[("Deployment", "m-llm")])["resources"] == expected


def test_the_operators_settings_size_containers() -> None:
    settings = SETTINGS.model_copy(
        update={
            "stage_requests": {"cpu": "1", "memory": "1536Mi"},
            "device_requests": {"cpu": "250m", "memory": "512Mi"},
            "limit_ratios": {"cpu": 0, "memory": 1.5},
        }
    )
    spec = spec_for("text", Vendor.NVIDIA)
    spec["stages"][0]["accelerator"]["count"] = 2
    out = by_kind_name(render(resolve("m", "ml", spec, settings, uid="u"), settings))
    # 1 + 2 x 250m CPUs and 1536Mi + 2 x 512Mi; a ratio of 0: no CPU limit.
    assert container(out[("Deployment", "m-llm")])["resources"] == {
        "limits": {"memory": "3840Mi", "nvidia.com/gpu": "2"},
        "requests": {"cpu": "1500m", "memory": "2560Mi"},
    }


def test_api_key_secret_reaches_the_gateway_env() -> None:
    spec = spec_for("text", Vendor.CPU) | {"gateway": {"apiKeySecret": "omni-key"}}
    gw = by_kind_name(render(resolve("m", "ml", spec, SETTINGS, uid="u"), SETTINGS))[("Deployment", "m-gateway")]
    env = {e["name"]: e for e in container(gw)["env"]}
    assert env["OMNIMODEL_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "omni-key", "key": "api-key"}


def test_pdb_rendered_when_asked() -> None:
    spec = spec_for("text", Vendor.CPU)
    spec["stages"][0]["disruption"] = {"minAvailable": 1}
    out = by_kind_name(render(resolve("m", "ml", spec, SETTINGS, uid="u"), SETTINGS))
    assert out[("PodDisruptionBudget", "m-llm")]["spec"]["minAvailable"] == 1


def test_pvc_model_source_is_mounted_read_only_where_the_runtime_looks() -> None:
    spec = spec_for("text", Vendor.CPU) | {"model": {"source": "pvc://weights/qwen/7b"}}
    deploy = by_kind_name(render(resolve("m", "ml", spec, SETTINGS, uid="u"), SETTINGS))[("Deployment", "m-llm")]
    pod = deploy["spec"]["template"]["spec"]
    assert {"name": "model-source", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} in pod[
        "volumes"
    ]
    assert {"name": "model-source", "mountPath": "/mnt/pvc/weights", "readOnly": True} in container(deploy)[
        "volumeMounts"
    ]


def test_pvc_source_needs_a_valid_claim_name() -> None:
    from omnimodel_operator.spec import InvalidSpec

    spec = spec_for("text", Vendor.CPU) | {"model": {"source": "pvc://Bad_Claim/x"}}
    with pytest.raises(InvalidSpec, match=r"spec\.model\.source"):
        resolve("m", "ml", spec, SETTINGS)


def test_provider_hpa_renders_a_horizontal_pod_autoscaler() -> None:
    doc = yaml.safe_load((REPO / "examples" / "tts.yaml").read_text())
    out = by_kind_name(render(resolve("speech", "ml", doc["spec"], SETTINGS, uid="u"), SETTINGS))
    hpa = out[("HorizontalPodAutoscaler", "speech-acoustic")]
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 3)
    assert hpa["spec"]["scaleTargetRef"]["name"] == "speech-acoustic"
    assert hpa["spec"]["metrics"] == [
        {"type": "Resource", "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 70}}}
    ]
    assert "replicas" not in out[("Deployment", "speech-acoustic")]["spec"]
    # An HPA on cpu needs a cpu request to divide by: the default one is there.
    requests = out[("Deployment", "speech-acoustic")]["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert requests["requests"]["cpu"] == "500m"


def test_stages_that_may_sit_at_zero_are_held_for_by_the_gateway() -> None:
    spec: dict[str, Any] = {
        "model": {"source": "tiny://qwen2.5-omni"},
        "preset": "qwen2.5-omni",
        "stages": [
            {"name": "talker", "autoscaling": {"minReplicas": 0, "maxReplicas": 2, "wakeTimeoutSeconds": 90}},
            {"name": "code2wav", "autoscaling": {"minReplicas": 0, "maxReplicas": 2}},
            {"name": "thinker", "autoscaling": {"maxReplicas": 2}},
        ],
    }
    gw = by_kind_name(render(resolve("m", "ml", spec, SETTINGS, uid="u"), SETTINGS))[("Deployment", "m-gateway")]
    env = {e["name"]: e.get("value") for e in container(gw)["env"]}
    assert json.loads(env["OMNIMODEL_STAGE_WAKE"]) == {"talker": 90, "code2wav": 300}
    del spec["stages"][:2]
    gw = by_kind_name(render(resolve("m", "ml", spec, SETTINGS, uid="u"), SETTINGS))[("Deployment", "m-gateway")]
    assert "OMNIMODEL_STAGE_WAKE" not in {e["name"] for e in container(gw)["env"]}
