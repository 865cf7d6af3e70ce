"""Namespaces that limit what pods may ask for, under the operator's shipped settings: a ResourceQuota that
requires limits admits every pod of an OmniModel (each container sets CPU and memory requests and limits),
and a LimitRange its pods exceed makes Ready=False within seconds, naming the stage in the API server's
words (before, status said "rolling out, 0/1 updated" forever)."""

from __future__ import annotations

import time
from typing import Any

from support import Kube, example, wait_for

REFUSED_DEADLINE = 15.0  # seconds, from the acceptance criteria


def refused_in_its_words(kube: Kube, name: str, deadline: float, since: float) -> tuple[dict[str, Any], float]:
    """Wait for Ready=False/FailedCreate on ``name``; return the condition and the seconds since ``since``."""

    def refused() -> dict[str, Any] | None:
        c = kube.condition(name)
        return c if c and (c["status"], c["reason"]) == ("False", "FailedCreate") else None

    ready: dict[str, Any] = wait_for(refused, deadline, interval=0.1, what=f"{name} Ready=False/FailedCreate")
    return ready, time.monotonic() - since


def replica_failure(obj: dict[str, Any]) -> dict[str, Any]:
    """A Deployment's or ReplicaSet's ReplicaFailure condition, as its controller wrote it."""
    failure: dict[str, Any] = next(c for c in obj["status"]["conditions"] if c["type"] == "ReplicaFailure")
    return failure


def test_a_resourcequota_that_requires_limits_admits_every_pod(kube: Kube) -> None:
    """A quota on limits.cpu/limits.memory and requests.*: the API server refuses any container without
    them ("must specify limits.cpu"). Every container the operator renders sets them, so both Deployments
    get their pods, and the quota counts what they ask for. ~10 s."""
    hard = {"limits.cpu": "16", "limits.memory": "32Gi", "requests.cpu": "8", "requests.memory": "32Gi"}
    kube.apply({"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "compute"}, "spec": {"hard": hard}})
    # Quota admission enforces a quota only once the quota controller has written its status.hard.
    wait_for(lambda: ((kube.get("resourcequota", "compute") or {}).get("status") or {}).get("hard"), 30,
             what="the quota controller to fill status.hard")  # fmt: skip
    kube.apply(example("text-tiny.yaml"))

    def created() -> bool:
        deployments = [kube.get("deployment", f"text-tiny-{c}") for c in ("llm", "gateway")]
        return all(d and (d.get("status") or {}).get("replicas") == d["spec"]["replicas"] for d in deployments)

    wait_for(created, 30, what="the stage's and the gateway's pods created")
    pods = kube.get("pod", selector="app.kubernetes.io/instance=text-tiny")["items"]
    for pod in pods:
        for c in pod["spec"]["containers"]:
            assert {"cpu", "memory"} <= set(c["resources"]["limits"]), (pod["metadata"]["name"], c["resources"])
    # What the pods asked for is what the quota now counts (stage 2 CPUs + gateway 1; 2Gi + 512Mi).
    used = wait_for(lambda: ((kube.get("resourcequota", "compute") or {}).get("status") or {}).get("used"), 15)
    assert (used["limits.cpu"], used["limits.memory"]) == ("3", "2560Mi"), used
    ready = kube.condition("text-tiny")
    assert ready is None or ready["reason"] != "FailedCreate", ready


def test_pods_a_limitrange_refuses_make_ready_false_with_the_api_servers_words(kube: Kube) -> None:
    """max cpu 200m: the stage's default CPU limit (2) is over it, so every pod the ReplicaSet creates is
    refused (Pod forbidden). The OmniModel says so within 15 s, naming the stage. ~5 s."""
    kube.apply(
        {
            "apiVersion": "v1",
            "kind": "LimitRange",
            "metadata": {"name": "cpu-max"},
            "spec": {"limits": [{"type": "Container", "max": {"cpu": "200m"}}]},
        }
    )
    applied = time.monotonic()
    kube.apply(example("text-tiny.yaml"))
    ready, took = refused_in_its_words(kube, "text-tiny", REFUSED_DEADLINE, applied)
    said = replica_failure(kube.get("deployment", "text-tiny-llm"))
    assert said["reason"] == "FailedCreate" and "maximum cpu usage per Container is 200m" in said["message"], said
    (replicaset,) = kube.get("replicaset", selector="app.kubernetes.io/instance=text-tiny,omnimodel.io/stage=llm")[
        "items"
    ]
    assert replica_failure(replicaset)["message"] == said["message"]  # the Deployment controller's copy
    assert f"llm: cannot create pods: {said['message']}" in ready["message"], ready
    progressing = kube.condition("text-tiny", "Progressing")
    assert progressing is not None and (progressing["status"], progressing["reason"]) == ("True", "FailedCreate")
    row = kube.get("omnimodel", "text-tiny")["status"]["stages"][0]
    assert (row["reason"], row["message"]) == ("FailedCreate", f"llm: cannot create pods: {said['message']}")
    print(f"Ready=False/FailedCreate {took:.2f}s after the apply: {ready['message']}")
