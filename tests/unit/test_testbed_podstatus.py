"""What the pod runner writes to a pod's status (podstatus.py), and how kwok is told to leave its pods
alone (runnerpods.py), and the volumes that bind claims (volumes.py): the pure parts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omnimodel_testbed import podstatus as ps
from omnimodel_testbed.runnerpods import RUNNER_LABEL, admission_policy, kwok_stages
from omnimodel_testbed.volumes import FOR_CLAIM, claim_volume, volume_name

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:01:00Z"


def test_a_terminated_state_reads_like_the_kubelets() -> None:
    done = ps.terminated(0, "Complete: ok", T0, T1)["terminated"]
    assert (done["exitCode"], done["reason"], done["message"]) == (0, "Completed", "Complete: ok")
    failed = ps.terminated(3, "", T0, T1)["terminated"]
    assert (failed["exitCode"], failed["reason"], "message" in failed) == (3, "Error", False)


def test_the_termination_log_file_wins_over_the_log(tmp_path: Path) -> None:
    message, log = tmp_path / "termination-log", tmp_path / "container.log"
    log.write_text("line 1\nTraceback: boom\n")
    policy = {"terminationMessagePolicy": "FallbackToLogsOnError"}
    message.write_text("Unauthorized: 401 Invalid credentials")
    assert ps.termination_message(policy, message, log, 0, 3) == "Unauthorized: 401 Invalid credentials"
    message.write_text("")
    # FallbackToLogsOnError: an empty file and a failure give the log's tail, from where this run began.
    assert ps.termination_message(policy, message, log, len("line 1\n"), 1) == "Traceback: boom\n"
    # Success, or the default policy, never falls back.
    assert ps.termination_message(policy, message, log, 0, 0) == ""
    assert ps.termination_message({}, message, log, 0, 1) == ""


def test_the_log_fallback_is_the_last_80_lines_at_most_2_kib(tmp_path: Path) -> None:
    log = tmp_path / "container.log"
    log.write_text("".join(f"{i}\n" for i in range(200)))
    tail = ps.log_tail(log)
    assert tail.splitlines() == [str(i) for i in range(120, 200)]
    log.write_text("x" * 5000 + "\nend\n")
    assert len(ps.log_tail(log).encode()) <= ps.FALLBACK_BYTES
    assert ps.log_tail(tmp_path / "absent.log") == ""


def statuses(spec: dict[str, Any], init: list[dict[str, Any]], main: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "init": [ps.container_status(c, s) for c, s in zip(spec.get("initContainers", []), init, strict=True)],
        "main": [
            ps.container_status(c, s, ready="running" in s) for c, s in zip(spec["containers"], main, strict=True)
        ],
    }


def conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


def test_pod_conditions_follow_the_containers_and_keep_their_transition_time() -> None:
    spec = {"initContainers": [{"name": "wait-weights"}], "containers": [{"name": "stage"}]}
    waiting = statuses(spec, [ps.running(T0)], [ps.waiting("PodInitializing")])
    first = ps.pod_status(spec, "Pending", waiting["init"], waiting["main"], start_time=T0, at=T0)
    cond = conditions(first)
    assert (cond["Initialized"]["status"], cond["Initialized"]["reason"]) == ("False", "ContainersNotInitialized")
    assert cond["Initialized"]["message"] == "containers with incomplete status: [wait-weights]"
    assert (cond["Ready"]["status"], cond["Ready"]["reason"]) == ("False", "ContainersNotReady")
    assert first["initContainerStatuses"][0]["state"] == {"running": {"startedAt": T0}}

    started = statuses(spec, [ps.terminated(0, "", T0, T1)], [ps.running(T1)])
    second = ps.pod_status(
        spec, "Running", started["init"], started["main"], start_time=T0, previous_conditions=first["conditions"], at=T1
    )
    cond = conditions(second)
    assert {t: c["status"] for t, c in cond.items()} == {
        "PodReadyToStartContainers": "True",
        "Initialized": "True",
        "ContainersReady": "True",
        "Ready": "True",
    }
    assert cond["PodReadyToStartContainers"]["lastTransitionTime"] == T0  # unchanged status keeps its time
    assert cond["Ready"]["lastTransitionTime"] == T1  # flipped


def test_a_finished_pod_is_not_ready_because_it_completed() -> None:
    spec = {"containers": [{"name": "fetch"}]}
    done = statuses(spec, [], [ps.terminated(3, "Unauthorized: no", T0, T1)])
    status = ps.pod_status(spec, "Failed", done["init"], done["main"], start_time=T0, at=T1)
    cond = conditions(status)
    assert (status["phase"], cond["Ready"]["reason"], cond["PodReadyToStartContainers"]["status"]) == (
        "Failed",
        "PodCompleted",
        "False",
    )
    assert "initContainerStatuses" not in status
    assert status["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 3


def kwok_stage(name: str, *, delete: bool = False, kind: str = "Pod") -> dict[str, Any]:
    spec: dict[str, Any] = {
        "resourceRef": {"apiGroup": "v1", "kind": kind},
        "selector": {"matchExpressions": [{"key": ".metadata.deletionTimestamp", "operator": "DoesNotExist"}]},
        "next": {"delete": True} if delete else {"statusTemplate": "phase: Running\n"},
    }
    return {"apiVersion": "kwok.x-k8s.io/v1alpha1", "kind": "Stage", "metadata": {"name": name}, "spec": spec}


def test_kwok_leaves_runner_pods_to_the_runner_and_deletes_them_only_after_their_grace_period() -> None:
    given = [kwok_stage("node-initialize", kind="Node"), kwok_stage("pod-ready"), kwok_stage("pod-delete", delete=True)]
    out = {s["metadata"]["name"]: s for s in kwok_stages(given)}
    label_query = f'.metadata.labels["{RUNNER_LABEL}"]'

    def expressions(name: str) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = out[name]["spec"]["selector"]["matchExpressions"]
        return found

    assert {"key": label_query, "operator": "DoesNotExist"} in expressions("pod-ready")
    assert {"key": label_query, "operator": "DoesNotExist"} in expressions("pod-delete")
    # A deleted runner pod: the runner removes it once stopped, kwok only once its grace period is over.
    deleting = out["pod-runner-delete"]["spec"]
    assert {"key": label_query, "operator": "Exists"} in deleting["selector"]["matchExpressions"]
    assert deleting["delay"] == {"durationFrom": {"expressionFrom": ".metadata.deletionTimestamp"}}
    assert deleting["next"] == {"delete": True}
    assert "selector" not in out["node-initialize"]["spec"] or all(
        e["key"] != label_query for e in expressions("node-initialize")
    )
    # The one stage runner pods get: an IP, once, and Pending.
    runner = expressions("pod-runner-create")
    assert {"key": label_query, "operator": "Exists"} in runner
    assert {"key": ".status.podIP", "operator": "DoesNotExist"} in runner
    assert "phase: Pending" in out["pod-runner-create"]["spec"]["next"]["statusTemplate"]
    assert given[1]["spec"]["selector"]["matchExpressions"] == [
        {"key": ".metadata.deletionTimestamp", "operator": "DoesNotExist"}
    ]  # the documents given are not changed


def test_the_admission_policy_labels_pods_of_served_namespaces_only() -> None:
    policy, binding = admission_policy()
    assert policy["spec"]["failurePolicy"] == "Fail"
    assert RUNNER_LABEL in policy["spec"]["mutations"][0]["applyConfiguration"]["expression"]
    (rule,) = policy["spec"]["matchConstraints"]["resourceRules"]
    assert (rule["resources"], rule["operations"]) == (["pods"], ["CREATE"])
    assert binding["spec"]["matchResources"]["namespaceSelector"] == {"matchLabels": {RUNNER_LABEL: "true"}}


def test_a_claims_volume_is_reserved_for_it_and_matches_it(tmp_path: Path) -> None:
    claim = {
        "metadata": {"name": "t2i-models", "namespace": "ml", "uid": "u-1"},
        "spec": {
            "accessModes": ["ReadWriteMany"],
            "storageClassName": "rwx",
            "resources": {"requests": {"storage": "5Gi"}},
        },
    }
    volume = claim_volume(claim, tmp_path / "claim")
    assert volume["metadata"]["name"] == "testbed-ml-t2i-models"
    assert volume["metadata"]["annotations"] == {FOR_CLAIM: "ml/t2i-models"}
    spec = volume["spec"]
    assert spec["claimRef"]["uid"] == "u-1"
    assert (spec["capacity"], spec["accessModes"], spec["storageClassName"]) == (
        {"storage": "5Gi"},
        ["ReadWriteMany"],
        "rwx",
    )
    assert spec["persistentVolumeReclaimPolicy"] == "Retain"  # never the in-tree hostPath deleter's rm -rf
    assert spec["hostPath"]["path"] == str(tmp_path / "claim")
    classless = claim_volume({"metadata": claim["metadata"], "spec": {}}, tmp_path)["spec"]
    assert (classless["storageClassName"], classless["accessModes"]) == ("", ["ReadWriteOnce"])


def test_volume_names_stay_within_the_api_limit() -> None:
    assert volume_name("ns", "c") == "testbed-ns-c"
    long = volume_name("n" * 63, "c" * 253)
    assert len(long) <= 253
    assert long != volume_name("n" * 63, "c" * 252 + "d")
