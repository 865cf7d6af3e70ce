"""Weights of hf:// models: the fetch Job, the claim, what stage pods mount, and WeightsReady."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from omnimodel_operator import conditions as cond
from omnimodel_operator.api.v1alpha1 import OmniModelSpec, OmniModelStatus
from omnimodel_operator.builders.weights import job_name
from omnimodel_operator.cli import main
from omnimodel_operator.observed import Observed
from omnimodel_operator.reconcile import merge_patch
from omnimodel_operator.runtimes import render, resolve
from omnimodel_operator.settings import OperatorSettings
from omnimodel_operator.status import ComponentState, compute_status
from omnimodel_operator.weights import keep_stage_bytes, weights_state

REPO = Path(__file__).parents[3]
SETTINGS = OperatorSettings()
SHA = "0123456789abcdef0123456789abcdef01234567"


def spec(**model: Any) -> dict[str, Any]:
    return {"model": {"source": "hf://acme/tiny-image", **model}, "preset": "text-to-image"}


def children(spec_: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    plan = resolve("img", "ml", spec_, SETTINGS, uid="u1")
    return {(m["kind"], m["metadata"]["name"]): m for m in render(plan, SETTINGS)}


def pod_spec(manifest: dict[str, Any]) -> dict[str, Any]:
    return manifest["spec"]["template"]["spec"]


def test_render_of_the_example_gives_the_token_to_the_fetcher_only(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The example's DiT runs on Ascend, which has no published runtime image: name one, as its cluster must.
    monkeypatch.setenv("OMNIMODEL_RUNTIME_IMAGES", json.dumps({"ascend": "registry.example.com/ml/rt:cann"}))
    assert main(["render", "-f", str(REPO / "examples" / "text-to-image.yaml"), "-n", "ml"]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    mentions = [f"{d['kind']}/{d['metadata']['name']}" for d in docs if "hf-token" in json.dumps(d)]
    assert len(mentions) == 1 and mentions[0].startswith("Job/qwen-image-fetch-"), mentions
    job = next(d for d in docs if d["kind"] == "Job")
    (container,) = pod_spec(job)["containers"]
    token = [e for e in container["env"] if e["name"] == "HF_TOKEN"]
    assert token == [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}}]
    claim = next(d for d in docs if d["kind"] == "PersistentVolumeClaim")
    assert claim["metadata"]["name"] == "qwen-image-models"
    assert claim["spec"] == {
        "storageClassName": "shared-rwx",
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": "80Gi"}},
    }


def test_stage_pods_mount_the_claim_read_only_wait_for_their_files_and_stay_offline() -> None:
    objs = children(spec(cache={"pvc": "weights"}, endpoint="http://mirror.ml:8090"))
    assert ("PersistentVolumeClaim", "img-models") not in objs  # a named claim is the user's
    job = next(m for (kind, _), m in objs.items() if kind == "Job")
    (fetch,) = pod_spec(job)["containers"]
    assert {"name": "HF_ENDPOINT", "value": "http://mirror.ml:8090"} in fetch["env"]
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "weights"}} in pod_spec(job)["volumes"]
    assert job["spec"]["podFailurePolicy"]["rules"][0]["onExitCodes"]["values"] == [3]
    for stage in ("encode", "denoise", "decode"):
        pod = pod_spec(objs[("Deployment", f"img-{stage}")])
        volume = next(v for v in pod["volumes"] if v["name"] == "model-cache")
        assert volume["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
        (init,) = pod["initContainers"]
        assert init["command"] == ["omnimodel", "wait-weights"] and init["args"][-2:] == ["--stage", stage]
        # A wait that fails (the fetch failed, a stage file missing) says why in the pod's status, as the
        # stage's own container does.
        assert init["terminationMessagePolicy"] == "FallbackToLogsOnError"
        (container,) = pod["containers"]
        mount = next(m for m in container["volumeMounts"] if m["name"] == "model-cache")
        assert mount == {"name": "model-cache", "mountPath": "/models", "readOnly": True}
        names = {e["name"]: e.get("value") for e in container["env"]}
        assert names["HF_HUB_OFFLINE"] == "1" and "HF_TOKEN" not in names and "HF_ENDPOINT" not in names
    gateway = pod_spec(objs[("Deployment", "img-gateway")])
    assert "model-cache" not in json.dumps(gateway)


def test_without_a_cache_nothing_is_fetched_and_each_pod_downloads_its_own() -> None:
    objs = children(spec())
    assert not [k for k in objs if k[0] in ("Job", "PersistentVolumeClaim")]
    pod = pod_spec(objs[("Deployment", "img-decode")])
    assert {"name": "model-cache", "emptyDir": {}} in pod["volumes"] and "initContainers" not in pod


def test_a_non_hub_source_with_a_cache_mounts_it_writable_and_fetches_nothing() -> None:
    objs = children({"model": {"source": "tiny://text-to-image", "cache": {"pvc": "cache"}}, "preset": "text-to-image"})
    assert not [k for k in objs if k[0] == "Job"]
    pod = pod_spec(objs[("Deployment", "img-decode")])
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "cache"}} in pod["volumes"]


def test_a_new_revision_is_a_new_job_and_rolls_the_stages() -> None:
    first = children(spec(cache={"pvc": "w"}, revision="v1"))
    second = children(spec(cache={"pvc": "w"}, revision="v2"))
    jobs = [{n for (k, n) in objs if k == "Job"} for objs in (first, second)]
    assert len(jobs[0]) == len(jobs[1]) == 1 and jobs[0] != jobs[1]
    hash_key = "omnimodel.io/pipeline-hash"
    for stage in ("encode", "decode"):
        a, b = (objs[("Deployment", f"img-{stage}")]["spec"]["template"]["metadata"] for objs in (first, second))
        assert a["annotations"][hash_key] != b["annotations"][hash_key]


@pytest.mark.parametrize(
    ("model", "words"),
    [
        ({"cache": {}}, "one of the two"),
        ({"cache": {"pvc": "a", "storageClassName": "b"}}, "one of the two"),
        ({"cache": {"pvc": "a", "size": "1Gi"}}, "need storageClassName"),
        ({"tokenSecret": {"name": "t"}}, "needs model.cache"),
        ({"source": "pvc://w/m", "endpoint": "http://x", "cache": {"pvc": "a"}}, "need an hf:// source"),
    ],
)
def test_bad_weights_settings_are_refused_by_name(model: dict[str, Any], words: str) -> None:
    with pytest.raises(ValidationError, match=words):
        OmniModelSpec.model_validate(spec(**model))


# ------------------------------------------------------------------------------------ WeightsReady


def job(*conditions: str) -> dict[str, Any]:
    return {"status": {"conditions": [{"type": t, "status": "True", "message": f"{t} msg"} for t in conditions]}}


def pod(phase: str, message: str = "", finished: str = "2026-12-01T10:00:00Z", **status: Any) -> dict[str, Any]:
    containers = []
    if phase in ("Succeeded", "Failed"):
        code = 0 if phase == "Succeeded" else 3
        state = {"exitCode": code, "message": message, "finishedAt": finished}
        containers = [{"name": "fetch", "state": {"terminated": state}}]
    return {"metadata": {"name": "p"}, "status": {"phase": phase, "containerStatuses": containers, **status}}


def test_weights_follow_the_job_from_pending_to_complete() -> None:
    missing = weights_state("img-fetch-1", None, None, [])
    assert (missing.status.state, missing.status.revision) == ("Pending", "main")
    unbound = pod(
        "Pending",
        conditions=[{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                     "message": 'pod has unbound immediate PersistentVolumeClaims'}],
    )  # fmt: skip
    pending = weights_state("img-fetch-1", "v1", job(), [unbound])
    assert pending.status.state == "Pending" and "unbound immediate PersistentVolumeClaims" in pending.condition_message
    progress = {"state": "downloading", "sha": SHA, "files_done": 2, "files_total": 8,
                "bytes_done": 250, "bytes_total": 1000}  # fmt: skip
    running = weights_state("img-fetch-1", "v1", job(), [pod("Running")], progress)
    assert running.status.model_dump(exclude_none=True) == {
        "state": "Fetching", "job": "img-fetch-1", "revision": "v1", "sha": SHA,
        "files_done": 2, "files_total": 8, "bytes_done": 250, "bytes_total": 1000,
        "message": "fetching 2/8 files, 250/1000 bytes (25.0%)",
    }  # fmt: skip
    line = f"Complete: acme/tiny-image@{SHA}: 8 files, 1000 bytes, 1000 bytes downloaded"
    done = weights_state("img-fetch-1", "v1", job("Complete"), [pod("Succeeded", line)])
    assert done.ready and done.status.sha == SHA and done.status.bytes_total == 1000
    assert done.status.message == line and done.status.stage_bytes is None  # an older fetch's line


def test_each_stages_share_comes_from_the_progress_then_the_complete_line_and_outlives_both() -> None:
    progress = {"state": "downloading", "sha": SHA, "bytes_done": 0, "bytes_total": 1000,
                "stage_bytes": {"encode": 300, "denoise": 600, "decode": 100}}  # fmt: skip
    running = weights_state("img-fetch-1", "v1", job(), [pod("Running")], progress)
    assert running.status.stage_bytes == {"encode": 300, "denoise": 600, "decode": 100}
    line = f"Complete: acme/tiny-image@{SHA}: 8 files, 1000 bytes, 0 bytes downloaded; stage bytes: encode=310 dit=690"
    done = weights_state("img-fetch-1", "v1", job("Complete"), [pod("Succeeded", line)])
    assert done.status.stage_bytes == {"encode": 310, "dit": 690}
    # The completed pod garbage-collected: the Job's Complete says nothing of sizes any more.
    bare = weights_state("img-fetch-1", "v1", job("Complete"), [])
    assert bare.status.stage_bytes is None
    assert keep_stage_bytes(bare, done.status).status.stage_bytes == {"encode": 310, "dit": 690}
    # Another Job (the revision or the file sets changed) fetches other bytes: nothing carries over.
    assert keep_stage_bytes(weights_state("img-fetch-2", "v2", None, []), done.status).status.stage_bytes is None


def test_a_retried_fetch_says_why_and_a_failed_one_gives_the_fetch_reason() -> None:
    first = pod("Failed", "Network: cannot reach http://mirror:8090", finished="2026-12-01T10:00:00Z")
    retrying = weights_state("j", None, job(), [first, pod("Running")])
    assert retrying.status.state == "Fetching" and "retrying after: Network: cannot reach" in retrying.condition_message
    wrong = pod(
        "Failed", "Unauthorized: 401 Client Error for acme/private (is HF_TOKEN right?)", "2026-12-01T10:01:00Z"
    )
    failed = weights_state("j", None, job("FailureTarget", "Failed"), [first, wrong])
    assert failed.failed and failed.condition_reason == "Unauthorized"
    assert failed.status.message is not None and failed.status.message.startswith("Unauthorized: 401")
    assert "delete the Job to fetch again" in failed.condition_message
    crashed = weights_state("j", None, job("Failed"), [pod("Failed", "Traceback (most recent call last): ...")])
    assert crashed.condition_reason == "Failed"


def status_with(weights: Any, stages_ready: bool = False) -> OmniModelStatus:
    plan = resolve("img", "ml", spec(cache={"pvc": "w"}), SETTINGS, uid="u1").plan
    reason = None if stages_ready else cond.UPDATING
    stages = [ComponentState(s.name, 1, int(stages_ready), 1, int(stages_ready), reason=reason) for s in plan.stages]
    gateway = ComponentState("gateway", 1, 1, 1, 1, reason=None)
    return compute_status(plan, stages, gateway, {}, OmniModelStatus(), 3, "2026-12-01T10:00:00Z", weights=weights)


def conditions_of(status: OmniModelStatus) -> dict[str, tuple[str, str]]:
    return {c.type: (c.status, c.reason) for c in status.conditions or ()}


def test_ready_waits_for_the_weights_and_names_a_failed_fetch() -> None:
    fetching = status_with(weights_state("img-fetch-1", None, job(), [pod("Running")]))
    got = conditions_of(fetching)
    assert got[cond.READY] == ("False", cond.FETCHING_WEIGHTS)
    assert got[cond.PROGRESSING] == ("True", cond.FETCHING_WEIGHTS)
    assert got[cond.WEIGHTS_READY] == ("False", "Fetching")
    assert fetching.served_modalities == []
    assert fetching.weights is not None and fetching.weights.state == "Fetching"
    failed = status_with(weights_state("j", None, job("Failed"), [pod("Failed", "NotFound: repository acme/x")]))
    assert conditions_of(failed)[cond.READY] == ("False", cond.WEIGHTS_FAILED)
    assert conditions_of(failed)[cond.WEIGHTS_READY] == ("False", "NotFound")
    line = f"Complete: acme/tiny-image@{SHA}: 8 files, 1000 bytes, 0 bytes downloaded"
    ready = status_with(weights_state("j", None, job("Complete"), [pod("Succeeded", line)]), stages_ready=True)
    assert conditions_of(ready)[cond.READY] == ("True", cond.ALL_READY)
    assert conditions_of(ready)[cond.WEIGHTS_READY] == ("True", "Complete")
    assert job_name(resolve("img", "ml", spec(cache={"pvc": "w"}), SETTINGS).plan).startswith("img-fetch-")


def test_a_failed_fetchs_reason_does_not_outlive_its_success_in_the_status_patch() -> None:
    # Status is written as a JSON merge patch, which keeps any key it does not name: nested keys that
    # went away are nulled, or Complete would still carry the retry's reason.
    old = {"weights": {"state": "Fetching", "job": "j", "reason": "Network"}, "stale": 1}
    new = {"weights": {"state": "Complete", "job": "j"}}
    assert merge_patch(old, new) == {"stale": None, "weights": {"reason": None, "state": "Complete", "job": "j"}}


def test_only_stages_without_devices_are_sized_by_their_own_files() -> None:
    spec_ = spec(cache={"pvc": "weights"})
    spec_["stages"] = [{"name": "decode", "accelerator": {"vendor": "cpu"}}]
    runtime = resolve("img", "ml", spec_, SETTINGS, uid="u1")
    sizes = {"encode": 9 * 2**30, "denoise": 40 * 2**30, "decode": 3 * 2**30 + 5}
    objs = {(m["kind"], m["metadata"]["name"]): m for m in render(runtime, SETTINGS, Observed(stage_bytes=sizes))}

    def requests(stage: str) -> dict[str, str]:
        (container,) = pod_spec(objs[("Deployment", f"img-{stage}")])["containers"]
        return dict(container["resources"]["requests"])

    # Its own share (not the whole model's 52 GiB) plus 1Gi, in whole bytes as the API server writes them.
    assert requests("decode")["memory"] == str(4 * 2**30 + 5)
    # GPU stages keep their weights on the device: the per-device default, whatever their files weigh.
    assert requests("denoise")["memory"] == requests("encode")["memory"] == "18Gi"
