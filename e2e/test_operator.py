"""The operator on a real control plane: apply, schedule, roll out, scale, prune, delete, restart."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from support import Kube, Operator, wait_for

REPO = Path(__file__).parents[1]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
STAGE = "omnimodel.io/stage"


def example(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((REPO / "examples" / name).read_text())
    return doc


def stage_pods(kube: Kube, cr: str, stage: str) -> list[dict[str, Any]]:
    return kube.pods(f"app.kubernetes.io/instance={cr},{STAGE}={stage}")


def stage_autoscaler(kube: Kube, cr: str, stage: str) -> dict[str, Any] | None:
    for row in ((kube.get("omnimodel", cr) or {}).get("status") or {}).get("stages") or []:
        if row["name"] == stage:
            return row.get("autoscaler")
    return None


def node_labels(kube: Kube, pod: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = kube.node(pod["spec"]["nodeName"])["metadata"].get("labels", {})
    return labels


def provide_cache(kube: Kube, doc: dict[str, Any], where: Path) -> None:
    """An example whose model.cache names a StorageClass gets a claim from the operator; the test bed
    has no provisioner, so stand in for one (as an administrator with static volumes would)."""
    if (doc["spec"].get("model", {}).get("cache") or {}).get("storageClassName"):
        kube.bind_claim(f"{doc['metadata']['name']}-models", where)


def provide_secrets(kube: Kube, doc: dict[str, Any]) -> None:
    """The Secrets an example names, as its comments tell the user to create them (the operator keeps an
    OmniModel Ready=False/SecretNotFound without them)."""
    token = doc["spec"].get("model", {}).get("tokenSecret")
    if token:
        data = {token.get("key", "token"): "hf_e2e"}
        kube.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": token["name"]}, "stringData": data})
    key = doc["spec"].get("gateway", {}).get("apiKeySecret")
    if key:
        kube.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": key}, "stringData": {"api-key": "e2e"}})


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_applies_and_becomes_ready(kube: Kube, path: Path, tmp_path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    provide_secrets(kube, doc)
    result = kube.run("apply", "-f", str(path))
    assert "created" in result.stdout
    provide_cache(kube, doc, tmp_path)
    name = doc["metadata"]["name"]
    kube.wait_ready(name)
    table = kube.run("get", "omni", name).stdout.splitlines()
    assert table[0].split() == ["NAME", "READY", "REASON", "STAGES", "OBSERVED", "ENDPOINT", "AGE"]
    row = table[1].split()
    stages = len(kube.get("omnimodel", name)["status"]["stages"])
    assert row[:6] == [
        name, "True", "AllStagesReady", f"{stages}/{stages}", "1", f"http://{name}-gateway.{kube.ns}.svc:8000",
    ]  # fmt: skip


def test_stages_land_on_the_requested_accelerators(kube: Kube) -> None:
    kube.apply(example("qwen-omni.yaml"))
    kube.wait_ready("qwen-omni")

    thinker = stage_pods(kube, "qwen-omni", "thinker")
    assert len(thinker) == 2
    for pod in thinker:
        assert node_labels(kube, pod)["nvidia.com/gpu.product"] == "NVIDIA-H200"
        assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    (talker,) = stage_pods(kube, "qwen-omni", "talker")
    assert node_labels(kube, talker)["amd.com/gpu.product-name"] == "AMD_Instinct_MI300X"
    (code2wav,) = stage_pods(kube, "qwen-omni", "code2wav")
    labels = node_labels(kube, code2wav)
    assert not any(k.startswith(("nvidia.com", "amd.com", "accelerator")) for k in labels), labels
    for pod in kube.pods("app.kubernetes.io/instance=qwen-omni,app.kubernetes.io/component=gateway"):
        assert "nvidia.com/gpu.present" not in node_labels(kube, pod)
    # provider operator (the default): the operator's autoscaler owns the talker, no HPA does.
    assert kube.get("hpa", "qwen-omni-talker") is None
    auto = wait_for(lambda: stage_autoscaler(kube, "qwen-omni", "talker"), 30, what="the talker's autoscaler status")
    assert (auto["kind"], auto["name"], auto["metric"], auto["target"]) == (
        "OmniModelAutoscaler",
        "qwen-omni-talker",
        "queueDepth",
        4,
    )
    # kwok's pods serve no metrics: the autoscaler holds the replicas it has and says why.
    assert auto["desiredReplicas"] == auto["currentReplicas"] == 1, auto


def test_product_pin_is_honoured_even_when_other_products_are_free(kube: Kube) -> None:
    """No B200 node exists; H200s have free GPUs. The pin must keep the stage Pending, not settle for H200."""
    doc = example("text-tiny.yaml")
    doc["spec"]["stages"][0]["accelerator"] = {"vendor": "nvidia", "product": "B200", "count": 1}
    kube.apply(doc)

    def insufficient() -> dict[str, Any] | None:
        c = kube.condition("text-tiny")
        return c if c and c["reason"] == "InsufficientCapacity" else None

    ready = wait_for(insufficient, 60, what="Ready=False/InsufficientCapacity")
    assert "node affinity/selector" in ready["message"]
    (pod,) = stage_pods(kube, "text-tiny", "llm")
    assert "nodeName" not in pod["spec"]


def test_stage_asking_for_more_devices_than_any_node_has_stays_pending(kube: Kube) -> None:
    doc = example("text-tiny.yaml")
    doc["spec"]["stages"][0]["accelerator"] = {"vendor": "nvidia", "product": "H200", "count": 16}
    kube.apply(doc)

    def insufficient() -> dict[str, Any] | None:
        c = kube.condition("text-tiny")
        return c if c and c["reason"] == "InsufficientCapacity" else None

    ready = wait_for(insufficient, 60, what="Ready=False/InsufficientCapacity")
    assert ready["status"] == "False"
    assert "llm" in ready["message"] and "Insufficient nvidia.com/gpu" in ready["message"]
    stages = {s["name"]: s for s in kube.get("omnimodel", "text-tiny")["status"]["stages"]}
    assert "Insufficient nvidia.com/gpu" in stages["llm"]["message"]
    (pod,) = stage_pods(kube, "text-tiny", "llm")
    assert pod["status"]["phase"] == "Pending"


def test_replicas_patch_is_followed(kube: Kube) -> None:
    kube.apply(example("text-tiny.yaml"))
    kube.wait_ready("text-tiny")
    kube.run(
        "patch", "omni", "text-tiny", "--type=json",
        "-p", '[{"op": "add", "path": "/spec/stages/0/replicas", "value": 3}]',
    )  # fmt: skip
    wait_for(lambda: kube.get("deployment", "text-tiny-llm")["spec"]["replicas"] == 3, 30, what="replicas=3")
    kube.wait_ready("text-tiny")
    assert kube.get("omnimodel", "text-tiny")["status"]["stages"][0]["readyReplicas"] == 3
    assert len(stage_pods(kube, "text-tiny", "llm")) == 3


def test_image_change_rolls_out_with_progressing_then_ready(kube: Kube) -> None:
    kube.apply(example("tts.yaml"))
    kube.wait_ready("speech")

    def rolling_out() -> list[dict[str, Any]]:
        return [
            e
            for e in kube.get("events")["items"]
            if e["reason"] == "RollingOut" and e["involvedObject"]["name"] == "speech"
        ]

    before = {e["metadata"]["name"] for e in rolling_out()}
    kube.run("patch", "omni", "speech", "--type=merge", "-p", '{"spec": {"runtime": {"image": "example.org/rt:2"}}}')
    kube.wait_ready("speech")
    for deploy in ("speech-acoustic", "speech-vocoder", "speech-gateway"):
        image = kube.get("deployment", deploy)["spec"]["template"]["spec"]["containers"][0]["image"]
        assert image == "example.org/rt:2"
    # Progressing was reported (as a RollingOut event naming the stages) before Ready came back
    new = [e for e in rolling_out() if e["metadata"]["name"] not in before]
    assert new
    assert any("acoustic" in e["message"] for e in new)
    progressing = kube.condition("speech", "Progressing")
    assert progressing is not None
    assert progressing["status"] == "False"


def test_removed_stage_children_are_deleted(kube: Kube) -> None:
    doc = example("custom-graph.yaml")
    doc["spec"]["stages"].append(
        {"name": "extra", "kind": "ar", "engine": "transformers", "task": "text-generation", "inputs": ["generate"]}
    )
    kube.apply(doc)
    kube.wait_ready("custom-chat")
    assert kube.get("deployment", "custom-chat-extra") is not None
    doc["spec"]["stages"].pop()
    kube.apply(doc)
    wait_for(lambda: kube.get("deployment", "custom-chat-extra") is None, 30, what="extra Deployment deleted")
    assert kube.get("service", "custom-chat-extra") is None
    assert kube.get("deployment", "custom-chat-generate") is not None
    kube.wait_ready("custom-chat")


def test_deleting_the_omnimodel_garbage_collects_everything(kube: Kube, tmp_path: Path) -> None:
    doc = example("text-to-image.yaml")
    provide_secrets(kube, doc)
    kube.apply(doc)
    provide_cache(kube, doc, tmp_path)
    kube.wait_ready("qwen-image")
    selector = "app.kubernetes.io/instance=qwen-image"
    assert kube.get("deployments", selector=selector)["items"]
    # no finalizer: deleting an OmniModel (or its namespace) never depends on the operator running
    assert not kube.get("omnimodel", "qwen-image")["metadata"].get("finalizers")
    kube.run("delete", "omni", "qwen-image", "--wait=true")
    kinds = ("deployments", "services", "configmaps", "pods", "poddisruptionbudgets", "networkpolicies", "jobs", "pvc")
    for kind in kinds:
        wait_for(lambda kind=kind: not kube.get(kind, selector=selector)["items"], 60, what=f"{kind} collected")


def test_operator_killed_with_a_half_applied_graph_converges_without_duplicates(kube: Kube, operator: Operator) -> None:
    """A ResourceQuota lets only two Deployments in, so the operator is certainly mid-graph (some
    children applied, the rest refused) when it is SIGKILLed; after the quota goes and the operator
    restarts, the graph converges with exactly one of each child."""
    kube.apply(
        {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "two-deployments"},
         "spec": {"hard": {"count/deployments.apps": "2"}}}
    )  # fmt: skip
    kube.apply(example("qwen-omni.yaml"))

    def refused() -> dict[str, Any] | None:
        c = kube.condition("qwen-omni")
        return c if c and c["reason"] == "ReconcileError" else None

    # The API server's own words, naming the refused child, reach status.
    message = wait_for(refused, 60, what="Ready=False/ReconcileError")["message"]
    assert "exceeded quota: two-deployments" in message and "Deployment" in message, message
    assert len(kube.get("deployments")["items"]) == 2
    operator.kill()
    kube.run("delete", "resourcequota", "two-deployments")
    operator.start()
    kube.wait_ready("qwen-omni")
    deployments = kube.get("deployments", selector="app.kubernetes.io/instance=qwen-omni")["items"]
    assert sorted(d["metadata"]["name"] for d in deployments) == [
        "qwen-omni-code2wav", "qwen-omni-gateway", "qwen-omni-talker", "qwen-omni-thinker",
    ]  # fmt: skip
    services = kube.get("services", selector="app.kubernetes.io/instance=qwen-omni")["items"]
    assert len(services) == 4
    assert len(stage_pods(kube, "qwen-omni", "thinker")) == 2


# -------------------------------------------------------------------------------------------- metrics


def metric_values(text: str, name: str) -> dict[frozenset[tuple[str, str]], float]:
    """Samples of one name from a /metrics text, as Prometheus parses it, keyed by their labels."""
    return {
        frozenset(s.labels.items()): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


def test_metrics_count_the_passes_that_made_an_omnimodel_ready(kube: Kube, operator: Operator) -> None:
    kube.run("apply", "-f", str(REPO / "examples" / "text-tiny.yaml"))
    kube.wait_ready("text-tiny")

    def counted() -> str | None:
        # The gauge follows each pass; the pass that wrote Ready=True may still be finishing.
        text = operator.scrape()
        ready = metric_values(text, "omnimodel_operator_omnimodels")
        return text if ready[frozenset({("ready", "True")})] >= 1 else None

    text: str = wait_for(counted, 30, what="a pass counting a Ready OmniModel")
    passes = metric_values(text, "omnimodel_operator_reconciles_total")
    ok = {dict(labels)["trigger"]: v for labels, v in passes.items() if dict(labels)["result"] == "ok"}
    # Created (an OmniModel event), then followed as its Deployments and pods rolled out (child events).
    assert ok["omnimodel"] > 0 and ok["child"] > 0, passes
    durations = metric_values(text, "omnimodel_operator_reconcile_duration_seconds_count")
    assert durations[frozenset({("trigger", "omnimodel")})] > 0
    requests: dict[str, float] = {}
    for labels, v in metric_values(text, "omnimodel_operator_api_requests_total").items():
        requests[dict(labels)["verb"]] = requests.get(dict(labels)["verb"], 0) + v
    # Its children were looked up (name conflicts) and applied, its status written, Ready announced.
    assert requests["get"] > 0 and requests["apply"] > 0 and requests["status"] > 0 and requests["event"] > 0
    assert "list" not in requests, requests  # every other read came from the watch-fed cache


# ------------------------------------------------------------------------------------------ CEL rules


def _bad(mutate: Any) -> dict[str, Any]:
    doc = copy.deepcopy(example("qwen-omni.yaml"))
    doc["metadata"]["name"] = "bad"
    mutate(doc["spec"])
    return doc


def _custom(stages: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "omnimodel.io/v1alpha1",
        "kind": "OmniModel",
        "metadata": {"name": "bad"},
        "spec": {"model": {"source": "tiny://text"}, "stages": stages},
    }


def _preset(preset: str, source: str, stages: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"model": {"source": source}, "preset": preset}
    if stages is not None:
        spec["stages"] = stages
    return {"apiVersion": "omnimodel.io/v1alpha1", "kind": "OmniModel", "metadata": {"name": "bad"}, "spec": spec}


def _vllm(stages: list[dict[str, Any]], source: str = "hf://Qwen/Qwen2.5-Omni-7B") -> dict[str, Any]:
    """A vLLM-Omni OmniModel on the qwen2_5_omni deploy config (thinker, the entry stage, is the head's)."""
    return {
        "apiVersion": "omnimodel.io/v1alpha1",
        "kind": "OmniModel",
        "metadata": {"name": "bad"},
        "spec": {
            "model": {"source": source},
            "runtime": {"kind": "vllm-omni", "deployConfig": "qwen2_5_omni"},
            "stages": stages,
        },
    }


def _stage(name: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "kind": "ar", "engine": "vllm", "task": "text-generation", **extra}


REJECTIONS: list[tuple[str, dict[str, Any], list[str]]] = [
    ("negative replicas", _bad(lambda s: s["stages"][0].update(replicas=-1)), ["spec.stages[0].replicas", "0"]),
    (
        "min above max",
        _bad(lambda s: s["stages"][1]["autoscaling"].update(minReplicas=5)),
        ["spec.stages[1].autoscaling.minReplicas", "must not exceed maxReplicas"],
    ),
    (
        "replicas and autoscaling",
        _bad(lambda s: s["stages"][1].update(replicas=2)),
        ["spec.stages[1].replicas", "mutually exclusive"],
    ),
    (
        "zero devices",
        _bad(lambda s: s["stages"][0]["accelerator"].update(count=0)),
        ["spec.stages[0].accelerator.count", "at least 1"],
    ),
    (
        "cpu with devices",
        _bad(lambda s: s["stages"][2]["accelerator"].update(count=2)),
        ["spec.stages[2].accelerator", "cpu accelerator takes neither count nor product"],
    ),
    (
        "stage not in preset",
        _bad(lambda s: s["stages"].append({"name": "talkr"})),
        ["spec.stages", "named like one of the preset's stages"],
    ),
    (
        "preset graph changed",
        _bad(lambda s: s["stages"][0].update(inputs=["talker"])),
        ["spec.stages", "a preset fixes the graph"],
    ),
    (
        "duplicate stage",
        _bad(lambda s: s["stages"].append({"name": "thinker"})),
        ["spec.stages[3]", "Duplicate value"],
    ),
    ("empty image", _bad(lambda s: s.update(runtime={"image": ""})), ["spec.runtime.image"]),
    ("empty source", _bad(lambda s: s["model"].update(source="")), ["spec.model.source"]),
    ("unknown scheme", _bad(lambda s: s["model"].update(source="ftp://x")), ["spec.model.source"]),
    ("no preset, no stages", _custom([]), ["spec.stages", "must describe the graph"]),
    (
        "missing task",
        _custom([{"name": "a", "kind": "ar", "engine": "vllm", "outputs": ["text"]}]),
        ["spec.stages", "needs engine, kind and task"],
    ),
    (
        "unknown input",
        _custom([_stage("a", outputs=["text"]), _stage("b", inputs=["zzz"])]),
        ["spec.stages", "must name stages of this OmniModel"],
    ),
    (
        "cycle",
        _custom([_stage("a", inputs=["b"], outputs=["text"]), _stage("b", inputs=["a"])]),
        ["spec.stages", "no cycle"],
    ),
    (
        "unknown task",
        _custom([{"name": "a", "kind": "ar", "engine": "vllm", "task": "text-gen", "outputs": ["text"]}]),
        ["spec.stages[0].task", "Unsupported value"],
    ),
    (
        "task the engine does not run",
        _custom([{"name": "a", "kind": "ar", "engine": "vllm", "task": "t2i-decode", "outputs": ["image"]}]),
        ["spec.stages[0].task", "the engine does not run this task"],
    ),
    (
        "vllm-omni stage not in the deploy config",
        _bad(
            lambda s: s.update(
                preset=None, runtime={"kind": "vllm-omni", "deployConfig": "qwen3_omni_moe"}, stages=[{"name": "talkr"}]
            )
        ),
        ["spec.stages", "named like one of the deploy config's stages"],
    ),
    (
        "vllm-omni stage scaled to zero",
        _bad(
            lambda s: s.update(
                preset=None,
                runtime={"kind": "vllm-omni", "deployConfig": "qwen2_5_omni"},
                stages=[{"name": "talker", "autoscaling": {"minReplicas": 0, "maxReplicas": 2}}],
            )
        ),
        ["spec.stages", "cannot scale to zero"],
    ),
    (
        "vllm-omni with a preset",
        _bad(lambda s: s.update(runtime={"kind": "vllm-omni", "deployConfig": "qwen2_5_omni"}, stages=None)),
        ["spec.preset", "not a preset"],
    ),
    (
        "deployConfig without vllm-omni",
        _bad(lambda s: s.update(runtime={"deployConfig": "qwen2_5_omni"})),
        ["spec.runtime.kind", "need runtime.kind vllm-omni"],
    ),
    (
        "unknown deploy config",
        _bad(lambda s: s.update(preset=None, stages=None, runtime={"kind": "vllm-omni", "deployConfig": "qwen9"})),
        ["spec.runtime.deployConfig", "Unsupported value"],
    ),
    (
        "engine that does not run the preset stage's task",
        _preset("text", "tiny://text", [{"name": "llm", "engine": "diffusers"}]),
        ["spec.stages", "a stage's engine must run that stage's task", "text llm: vllm or transformers"],
    ),
    (
        "another preset's tiny model",
        _preset("text", "tiny://text-to-image"),
        ["spec.model.source", "with preset P, model.source must be tiny://P"],
    ),
    ("unknown tiny model", _preset("text", "tiny://nosuchpreset"), ["spec.model.source", "no such tiny model"]),
    (
        "vllm-omni with a tiny model",
        _vllm([], source="tiny://qwen2.5-omni-vllm-omni"),
        ["spec.model.source", "tiny:// models are built by the omnimodel runtime"],
    ),
    (
        "vllm-omni engineArgs the operator sets",
        _vllm([{"name": "talker", "engineArgs": {"devices": "0,1"}}]),
        ["spec.stages", "engineArgs devices and num_replicas are set by the operator"],
    ),
    (
        "vllm-omni accelerator count unlike the stage's",
        _vllm([{"name": "talker", "accelerator": {"vendor": "nvidia", "count": 2}}]),
        ["spec.stages", "accelerator.count (default 1) must be the devices one replica of it uses"],
    ),
    (
        "vllm-omni tensor parallel without the devices",
        _vllm([{"name": "talker", "engineArgs": {"tensor_parallel_size": 2}, "accelerator": {"vendor": "nvidia"}}]),
        ["spec.stages", "scaled by engineArgs.tensor_parallel_size"],
    ),
    (
        "vllm-omni head stage at zero",
        _vllm([{"name": "thinker", "replicas": 0}]),
        ["spec.stages", "the entry stage runs in the head pod", "at least 1"],
    ),
    (
        "vllm-omni head stage autoscaled",
        _vllm([{"name": "thinker", "autoscaling": {"maxReplicas": 2}}]),
        ["spec.stages", "cannot autoscale"],
    ),
    (
        "reserved stage name",
        _custom([{"name": "gateway", "kind": "ar", "engine": "vllm", "task": "text-generation", "outputs": ["text"]}]),
        ["spec.stages[0].name", "reserved"],
    ),
]


def test_autoscaling_needs_only_max_replicas(kube: Kube) -> None:
    """minReplicas defaults to 1 and target per metric: the CEL rule must not demand either."""
    doc = _bad(lambda s: s["stages"][1].update(autoscaling={"maxReplicas": 3}))
    doc["metadata"]["name"] = "scaled"
    kube.apply(doc)
    auto = wait_for(lambda: stage_autoscaler(kube, "scaled", "talker"), 30, what="the talker's autoscaler status")
    assert (auto["kind"], auto["metric"], auto["target"]) == ("OmniModelAutoscaler", "inFlight", 4)
    # The same on provider hpa: an HPA with the defaults.
    doc["spec"]["stages"][1]["autoscaling"]["provider"] = "hpa"
    kube.apply(doc)
    hpa = wait_for(lambda: kube.get("hpa", "scaled-talker"), 30, what="the talker's HPA")
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 3)
    assert hpa["spec"]["metrics"][0]["pods"]["target"]["averageValue"] == "4"


@pytest.mark.parametrize(("case", "doc", "expected"), REJECTIONS, ids=[r[0] for r in REJECTIONS])
def test_api_server_rejects_invalid_objects(kube: Kube, case: str, doc: dict[str, Any], expected: list[str]) -> None:
    result = kube.apply(doc, check=False)
    assert result.returncode != 0, f"{case}: accepted"
    for text in expected:
        assert text in result.stderr, f"{case}: {text!r} not in {result.stderr!r}"
    assert kube.get("omnimodel", "bad") is None


ACCEPTED: list[tuple[str, dict[str, Any]]] = [
    (
        "a preset stage on another engine that runs its task",
        _preset("text", "tiny://text", [{"name": "llm", "engine": "transformers"}]),
    ),
    ("a preset's tiny model variant", _preset("qwen2.5-omni", "tiny://qwen2.5-omni-vllm-omni")),
    (
        "vllm-omni tensor parallel with its devices",
        _vllm(
            [
                {
                    "name": "talker",
                    "engineArgs": {"tensor_parallel_size": 2},
                    "accelerator": {"vendor": "nvidia", "count": 2},
                }
            ]
        ),
    ),
    ("vllm-omni head stage with replicas", _vllm([{"name": "thinker", "replicas": 2}])),
    ("vllm-omni non-head stage autoscaled", _vllm([{"name": "talker", "autoscaling": {"maxReplicas": 2}}])),
]


@pytest.mark.parametrize(("case", "doc"), ACCEPTED, ids=[a[0] for a in ACCEPTED])
def test_api_server_accepts_what_the_rules_allow(kube: Kube, case: str, doc: dict[str, Any]) -> None:
    """The rules above refuse only what they name: their neighbours still pass (server-side dry run)."""
    result = kube.run("apply", "--dry-run=server", "-f", "-", stdin=yaml.safe_dump(doc), check=False)
    assert result.returncode == 0, f"{case}: {result.stderr}"


class CountingKube:
    """The real client, counting every call."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name in ("apply", "delete", "patch_status", "create", "get", "list"):

            async def counted(*args: Any, **kwargs: Any) -> Any:
                self.calls.append(name)
                return await attr(*args, **kwargs)

            return counted
        return attr


async def listed(client: Any, namespace: str, name: str) -> Any:
    """What the operator's watch-fed cache holds for one OmniModel, read with LISTs instead."""
    from omnimodel_operator.kinds import CHILD_KINDS
    from omnimodel_operator.naming import owned_selector
    from omnimodel_operator.observed import Observed

    selector = owned_selector(name)
    objects = {}
    for child in CHILD_KINDS:
        for obj in await client.list(child.api_version, child.kind, namespace, selector):
            objects[(child.kind, obj["metadata"]["name"])] = obj
    return Observed(objects=objects, pods=await client.list("v1", "Pod", namespace, selector))


async def test_noop_reconcile_makes_no_api_requests_against_the_real_server(kube: Kube, tmp_path: Path) -> None:
    """Server defaulting, omitempty and normalised quantities must not make a pass re-apply
    (DESIGN §8: writes = 0); with the cache current, a pass sends no request at all."""
    from omnimodel_operator.api.v1alpha1 import AutoscalerStatus
    from omnimodel_operator.kube import LightKube, load_config
    from omnimodel_operator.reconcile import reconcile
    from omnimodel_operator.settings import OperatorSettings
    from omnimodel_testbed.registry import RegistryImages

    for name in ("qwen-omni.yaml", "text-to-image.yaml", "tts.yaml", "custom-graph.yaml"):
        provide_secrets(kube, doc := example(name))
        kube.apply(doc)
        provide_cache(kube, doc, tmp_path)
    for name in ("qwen-omni", "qwen-image", "speech", "custom-chat"):
        kube.wait_ready(name)
    client = LightKube(load_config(str(kube.cluster.kubeconfig)))
    counting = CountingKube(client)
    # The running operator's settings: the test bed's images for every vendor (support.Operator).
    assert kube.cluster.state is not None
    settings = OperatorSettings(runtime_images=RegistryImages.of(kube.cluster.state).runtime_images())
    try:
        for name in ("qwen-omni", "qwen-image", "speech", "custom-chat"):
            body = await client.get("omnimodel.io/v1alpha1", "OmniModel", kube.ns, name)
            assert body is not None
            observed = await listed(client, kube.ns, name)
            # What the running operator's autoscaler last decided, as its controller passes it: the pass
            # must reproduce the status it wrote, not one without those decisions.
            autoscalers = {
                row["name"]: AutoscalerStatus.model_validate(row["autoscaler"])
                for row in (body.get("status") or {}).get("stages") or []
                if (row.get("autoscaler") or {}).get("kind") == "OmniModelAutoscaler"
            }
            outcome = await reconcile(counting, body, observed, settings, autoscalers=autoscalers)
            assert outcome.applied == [], name
    finally:
        await client.aclose()
    assert counting.calls == []
