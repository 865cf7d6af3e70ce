"""Drift from managed fields, checked against an object the real API server produced.

``data/deployment-after-kubectl-edits.json`` was recorded on the test bed's kube-apiserver 1.36: a
Deployment server-side applied by ``omnimodel-operator``, then ``kubectl set image``, ``kubectl set env
B=2`` and ``kubectl scale --replicas=3``. The server moved ``image`` and ``replicas`` to the kubectl
managers, kept ``env`` ours and added ``B`` under ``kubectl-set``, and normalised ``cpu: 1.5`` to
``1500m``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from omnimodel_operator import constants as C
from omnimodel_operator.drift import applied_fields, drift, unowned_fields

RECORDED = json.loads((Path(__file__).parent / "data" / "deployment-after-kubectl-edits.json").read_text())

# What the operator applied before the edits (the test's own copy of the request).
APPLIED: dict[str, Any] = {
    "apiVersion": "apps/v1",
    "kind": "Deployment",
    "metadata": {"name": "drift", "namespace": "default", "labels": {"a": "b"}, "annotations": {"x": "1"}},
    "spec": {
        "replicas": 1,
        "selector": {"matchLabels": {"app": "drift"}},
        "template": {
            "metadata": {"labels": {"app": "drift"}},
            "spec": {
                "containers": [
                    {
                        "name": "c",
                        "image": "img:1",
                        "env": [{"name": "A", "value": "1"}, {"name": "E", "value": ""}],
                        "ports": [{"name": "http", "containerPort": 8001, "protocol": "TCP"}],
                        "resources": {"requests": {"cpu": "1.5", "memory": "1G"}},
                    }
                ],
                "tolerations": [{"key": "k", "operator": "Exists"}],
            },
        },
    },
}


def fields() -> Any:
    found = applied_fields(RECORDED)
    assert found is not None
    return found


def without(path: list[str | int]) -> dict[str, Any]:
    out = copy.deepcopy(APPLIED)
    node: Any = out
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]
    return out


def test_fields_another_manager_changed_are_drift() -> None:
    assert sorted(unowned_fields(APPLIED, fields())) == [".spec.replicas", ".spec.template.spec.containers[0].image"]


def test_additions_by_other_managers_and_server_normalisation_are_not_drift() -> None:
    """The kubectl-set env var B and cpu 1.5 → 1500m: nothing to re-apply, so no apply loop."""
    desired = without(["spec", "replicas"])
    del desired["spec"]["template"]["spec"]["containers"][0]["image"]
    assert unowned_fields(desired, fields()) == []


def test_atomic_lists_and_structs_are_owned_whole() -> None:
    """tolerations (an atomic list) and selector (an atomic struct) are leaves in the field set."""
    desired = without(["spec", "replicas"])
    del desired["spec"]["template"]["spec"]["containers"][0]["image"]
    desired["spec"]["template"]["spec"]["tolerations"] = [{"key": "other", "operator": "Exists"}]
    assert unowned_fields(desired, fields()) == []


def test_a_new_list_entry_we_set_is_drift_until_applied() -> None:
    desired = without(["spec", "replicas"])
    del desired["spec"]["template"]["spec"]["containers"][0]["image"]
    desired["spec"]["template"]["spec"]["containers"][0]["env"].append({"name": "NEW", "value": "x"})
    assert unowned_fields(desired, fields()) == [".spec.template.spec.containers[0].env[2]"]


def test_drift_reasons() -> None:
    desired = copy.deepcopy(APPLIED)
    desired["metadata"]["annotations"][C.ANNOTATION_APPLIED_HASH] = "h1"
    live = copy.deepcopy(RECORDED)
    assert drift(desired, None) == "missing"
    assert drift(desired, live) == "changed"  # no applied-hash annotation on the recorded object
    live["metadata"]["annotations"][C.ANNOTATION_APPLIED_HASH] = "h1"
    reason = drift(desired, live)
    assert reason is not None
    assert reason.startswith("changed by another field manager")
    assert "spec.replicas" in reason
    live["metadata"]["managedFields"] = [
        m for m in live["metadata"]["managedFields"] if m["manager"] != C.FIELD_MANAGER
    ]
    assert drift(desired, live) == "not applied by the operator"
