"""Condition transitions from child state: the cases that used to flap or lie, one by one."""

from __future__ import annotations

from typing import Any

import pytest

from omnimodel_operator import conditions as cond
from omnimodel_operator.api.v1alpha1 import OmniModelStatus
from omnimodel_operator.resolve import Plan, resolve_omnimodel
from omnimodel_operator.settings import OperatorSettings
from omnimodel_operator.spec import parse_spec
from omnimodel_operator.status import ComponentState, Problems, component_state, compute_status

SETTINGS = OperatorSettings()
NOW = "2026-01-01T00:00:00Z"


def plan() -> Plan:
    spec = {"model": {"source": "tiny://qwen2.5-omni"}, "preset": "qwen2.5-omni"}
    return resolve_omnimodel("m", "ml", parse_spec(spec), SETTINGS, uid="u")


def deployment(desired: int, *, updated: int, available: int, total: int | None = None, gen: int = 2, seen: int = 2,
               conditions: list[dict[str, Any]] | None = None) -> dict[str, Any]:  # fmt: skip
    return {
        "metadata": {"name": "d", "generation": gen},
        "spec": {"replicas": desired},
        "status": {
            "observedGeneration": seen,
            "replicas": desired if total is None else total,
            "updatedReplicas": updated,
            "availableReplicas": available,
            "readyReplicas": available,
            "conditions": conditions or [],
        },
    }


UNSCHEDULABLE = {
    "metadata": {"name": "p"},
    "status": {
        "conditions": [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/6 nodes: Insufficient nvidia.com/gpu",
            }
        ]
    },
}


COMPLETE = [{"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable"}]
UPDATED = [{"type": "Progressing", "status": "True", "reason": "ReplicaSetUpdated"}]


def ready(name: str, n: int = 1) -> ComponentState:
    return component_state(name, deployment(n, updated=n, available=n, conditions=COMPLETE), [])


def conditions(status: OmniModelStatus) -> dict[str, tuple[str, str]]:
    return {c.type: (c.status, c.reason) for c in status.conditions or ()}


def roll_up(*stages: ComponentState, gateway: ComponentState | None = None, old: OmniModelStatus | None = None,
            problems: Problems | None = None) -> OmniModelStatus:  # fmt: skip
    return compute_status(
        plan(), list(stages), gateway or ready("gateway"), {}, old or OmniModelStatus(), 2, NOW, problems or Problems()
    )


def test_everything_available_is_ready_and_complete() -> None:
    status = roll_up(ready("thinker"), ready("talker"), ready("code2wav"))
    assert conditions(status) == {
        cond.READY: ("True", cond.ALL_READY),
        cond.PROGRESSING: ("False", cond.ROLLOUT_COMPLETE),
        cond.DEGRADED: ("False", cond.AS_EXPECTED),
    }
    assert status.served_modalities == ["text", "audio"]


def test_a_rollout_is_progressing_not_degraded() -> None:
    talker = component_state("talker", deployment(2, updated=1, available=1, total=3), [])
    status = roll_up(ready("thinker"), talker, ready("code2wav"))
    assert conditions(status)[cond.PROGRESSING] == ("True", cond.UPDATING)
    assert conditions(status)[cond.DEGRADED] == ("False", cond.AS_EXPECTED)
    assert conditions(status)[cond.READY] == ("False", cond.UPDATING)


@pytest.mark.parametrize("case", ["scale-up", "template change with maxSurge 0"])
def test_pods_still_to_come_are_progressing_not_degraded(case: str) -> None:
    """The Deployment controller marks progress (ReplicaSetUpdated) as soon as it scales or rolls; a
    maxSurge-0 rollout has its old pod gone and the new one pending, with every count 'current'."""
    desired = 3 if case == "scale-up" else 1
    talker = component_state("talker", deployment(desired, updated=desired, available=0, conditions=UPDATED), [])
    status = roll_up(ready("thinker"), talker, ready("code2wav"))
    assert conditions(status)[cond.PROGRESSING] == ("True", cond.PODS_NOT_READY)
    assert conditions(status)[cond.DEGRADED] == ("False", cond.AS_EXPECTED)


def test_losing_a_pod_after_a_completed_rollout_is_degraded_until_it_is_back() -> None:
    talker = component_state("talker", deployment(2, updated=2, available=1, conditions=COMPLETE), [])
    lost = roll_up(ready("thinker"), talker, ready("code2wav"))
    assert conditions(lost)[cond.DEGRADED] == ("True", cond.PODS_NOT_READY)
    assert conditions(lost)[cond.PROGRESSING] == ("False", cond.ROLLOUT_COMPLETE)
    assert lost.stages[1].reason == cond.CAPACITY_LOST  # type: ignore[index]
    back = component_state("talker", deployment(2, updated=2, available=2, conditions=COMPLETE), [])
    assert conditions(roll_up(ready("thinker"), back, ready("code2wav"), old=lost))[cond.DEGRADED][0] == "False"


def test_a_rollout_stuck_on_capacity_is_progressing_with_the_reason() -> None:
    stuck = component_state("thinker", deployment(1, updated=0, available=1, total=2), [UNSCHEDULABLE])
    status = roll_up(stuck, ready("talker"), ready("code2wav"))
    assert conditions(status)[cond.PROGRESSING] == ("True", cond.INSUFFICIENT_CAPACITY)
    assert conditions(status)[cond.READY] == ("False", cond.INSUFFICIENT_CAPACITY)
    assert "Insufficient nvidia.com/gpu" in next(c.message for c in status.conditions or () if c.type == cond.READY)


def test_a_rollout_past_its_deadline_says_so() -> None:
    deadline = [
        {
            "type": "Progressing",
            "status": "False",
            "reason": "ProgressDeadlineExceeded",
            "message": "ReplicaSet x has timed out progressing.",
        }
    ]
    stuck = component_state("thinker", deployment(1, updated=1, available=0, total=2, conditions=deadline), [])
    assert conditions(roll_up(stuck, ready("talker"), ready("code2wav")))[cond.PROGRESSING] == (
        "True",
        cond.PROGRESS_DEADLINE_EXCEEDED,
    )


def test_an_optional_stage_at_zero_still_serves_text() -> None:
    talker = component_state("talker", deployment(0, updated=0, available=0), [])
    code2wav = component_state("code2wav", deployment(0, updated=0, available=0), [])
    status = roll_up(ready("thinker"), talker, code2wav)
    assert conditions(status)[cond.READY] == ("True", cond.STAGES_SCALED_TO_ZERO)
    assert status.served_modalities == ["text"]
    assert status.stages[1].reason == cond.SCALED_TO_ZERO  # type: ignore[index]


@pytest.mark.parametrize("zero", ["thinker", "gateway"])
def test_nothing_servable_is_not_ready(zero: str) -> None:
    at_zero = component_state(zero, deployment(0, updated=0, available=0), [])
    stages = [at_zero if zero == "thinker" else ready("thinker"), ready("talker"), ready("code2wav")]
    status = roll_up(*stages, gateway=at_zero if zero == "gateway" else None)
    assert conditions(status)[cond.READY] == ("False", cond.SCALED_TO_ZERO)
    assert status.served_modalities == []


def test_refused_children_and_name_conflicts_are_never_ready() -> None:
    stages = (ready("thinker"), ready("talker"), ready("code2wav"))
    refused = roll_up(
        *stages, problems=Problems(apply_errors=("PodDisruptionBudget ml/m-talker: invalid minAvailable",))
    )
    assert conditions(refused)[cond.READY] == ("False", cond.RECONCILE_ERROR)
    conflict = roll_up(*stages, problems=Problems(conflicts=("Service ml/m-talker exists and ...",)))
    assert conditions(conflict)[cond.READY] == ("False", cond.NAME_CONFLICT)


def test_transition_time_moves_only_when_status_flips() -> None:
    first = roll_up(ready("thinker"), ready("talker"), ready("code2wav"))
    later = compute_status(
        plan(), [ready("thinker"), ready("talker"), ready("code2wav")], ready("gateway"), {}, first, 3,
        "2026-01-01T01:00:00Z",
    )  # fmt: skip
    assert [c.last_transition_time for c in later.conditions or ()] == [NOW] * 3
    assert {c.observed_generation for c in later.conditions or ()} == {3}


def test_a_stage_the_autoscaler_took_to_zero_still_serves_on_demand() -> None:
    """minReplicas 0: the gateway holds the talker's requests while it wakes, so speech stays served."""
    spec = {
        "model": {"source": "tiny://qwen2.5-omni"},
        "preset": "qwen2.5-omni",
        "stages": [{"name": "talker", "autoscaling": {"minReplicas": 0, "maxReplicas": 2}}],
    }
    wakeable = resolve_omnimodel("m", "ml", parse_spec(spec), SETTINGS, uid="u")
    talker = component_state("talker", deployment(0, updated=0, available=0), [])
    status = compute_status(wakeable, [ready("thinker"), talker, ready("code2wav")], ready("gateway"), {},
                            OmniModelStatus(), 2, NOW, Problems())  # fmt: skip
    assert conditions(status)[cond.READY] == ("True", cond.ALL_READY)
    assert "talker idle at 0 replicas" in next(c.message for c in status.conditions or () if c.type == cond.READY)
    assert status.served_modalities == ["text", "audio"]
    assert status.stages[1].reason == cond.SCALED_TO_ZERO  # type: ignore[index]


# What Kubernetes refuses reaches Ready with the stage named and Kubernetes' own message. The Deployment
# statuses below were recorded on the test bed's kube-apiserver and controller-manager 1.36 (a stage-like
# Deployment requesting 500m CPU and no limit), names and times aside; the webhook's message is in the
# API server's format for a denial ("admission webhook %q denied the request: %s").
def _condition(type_: str, status: str, reason: str, message: str) -> dict[str, Any]:
    t = "2026-01-01T00:00:00Z"
    return {
        "lastTransitionTime": t,
        "lastUpdateTime": t,
        "message": message,
        "reason": reason,
        "status": status,
        "type": type_,
    }


NEW_RS = _condition("Progressing", "True", "NewReplicaSetCreated", 'Created new replica set "m-thinker-57f444985c"')
UNAVAILABLE = _condition(
    "Available", "False", "MinimumReplicasUnavailable", "Deployment does not have minimum availability."
)
AVAILABLE = _condition("Available", "True", "MinimumReplicasAvailable", "Deployment has minimum availability.")
REFUSALS = {
    # LimitRange max cpu 200m: its default limit (= max) goes below the 500m request.
    "LimitRange max": 'Pod "m-thinker-57f444985c-mx424" is invalid: spec.containers[0].resources.requests: '
    'Invalid value: "500m": must be less than or equal to cpu limit of 200m',
    "LimitRange min": 'pods "m-thinker-57f444985c-5h6gl" is forbidden: minimum cpu usage per Container is 1, '
    "but request is 500m",
    "ResourceQuota": 'pods "m-thinker-57f444985c-6ldq4" is forbidden: failed quota: q: must specify limits.cpu '
    "for: stage; limits.memory for: stage",
    "admission webhook": 'admission webhook "validate.kyverno.svc-fail" denied the request: require-limits',
}


def _ready_condition(status: OmniModelStatus) -> Any:
    return next(c for c in status.conditions or () if c.type == cond.READY)


@pytest.mark.parametrize("refusal", REFUSALS)
def test_pods_the_api_server_refuses_are_failed_create_with_its_message(refusal: str) -> None:
    """The first rollout: the ReplicaSet exists, not one pod of it does (the issue's "0/1 updated" forever)."""
    message = REFUSALS[refusal]
    failure = _condition("ReplicaFailure", "True", "FailedCreate", message)
    status_ = {
        "observedGeneration": 1,
        "terminatingReplicas": 0,
        "unavailableReplicas": 1,
        "conditions": [NEW_RS, UNAVAILABLE, failure],
    }
    thinker = component_state(
        "thinker", {"metadata": {"name": "m-thinker", "generation": 1}, "spec": {"replicas": 1}, "status": status_}, []
    )
    status = roll_up(thinker, ready("talker"), ready("code2wav"))
    assert conditions(status)[cond.READY] == ("False", cond.FAILED_CREATE)
    assert conditions(status)[cond.PROGRESSING] == ("True", cond.FAILED_CREATE)
    assert conditions(status)[cond.DEGRADED] == ("False", cond.AS_EXPECTED)
    assert _ready_condition(status).message == f"thinker: cannot create pods: {message}"
    row = status.stages[0]  # type: ignore[index]
    assert (row.reason, row.message) == (cond.FAILED_CREATE, f"thinker: cannot create pods: {message}")


def test_a_rollout_whose_new_pods_are_refused_is_not_just_rolling_out() -> None:
    """A LimitRange (min cpu 1) added after the first rollout, then a template change: the old pod
    serves, the new ReplicaSet's pods are refused."""
    failure = _condition("ReplicaFailure", "True", "FailedCreate", REFUSALS["LimitRange min"])
    status_ = {
        "availableReplicas": 1,
        "observedGeneration": 2,
        "readyReplicas": 1,
        "replicas": 1,
        "terminatingReplicas": 0,
        "unavailableReplicas": 1,
        "conditions": [AVAILABLE, NEW_RS, failure],
    }
    thinker = component_state(
        "thinker", {"metadata": {"name": "m-thinker", "generation": 2}, "spec": {"replicas": 1}, "status": status_}, []
    )
    assert (thinker.reason, thinker.message) == (
        cond.FAILED_CREATE,
        f"thinker: cannot create pods: {REFUSALS['LimitRange min']}",
    )


def test_a_replicaset_the_api_server_refuses_is_failed_create_with_its_message() -> None:
    """A quota on ReplicaSets: the Deployment controller cannot create the new one (and leaves
    observedGeneration behind)."""
    message = (
        'Failed to create new replica set "m-thinker-c554dc6c4": replicasets.apps "m-thinker-c554dc6c4" is forbidden: '
        "exceeded quota: rs, requested: count/replicasets.apps=1, used: count/replicasets.apps=1, "
        "limited: count/replicasets.apps=1"
    )
    status_ = {
        "availableReplicas": 1,
        "observedGeneration": 1,
        "readyReplicas": 1,
        "replicas": 1,
        "terminatingReplicas": 0,
        "updatedReplicas": 1,
        "conditions": [AVAILABLE, _condition("Progressing", "False", "ReplicaSetCreateError", message)],
    }
    thinker = component_state(
        "thinker", {"metadata": {"name": "m-thinker", "generation": 2}, "spec": {"replicas": 1}, "status": status_}, []
    )
    status = roll_up(thinker, ready("talker"), ready("code2wav"))
    assert conditions(status)[cond.READY] == ("False", cond.FAILED_CREATE)
    assert _ready_condition(status).message == f"thinker: {message}"


# Pods shaped as the kubelet reports them, messages in its formats (image pulls, CrashLoopBackOff).
def _pod(container: dict[str, Any], *, deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "m-thinker-7c9d8b6f5-x2x7q", "namespace": "ml"}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:30Z"
    base = {
        "name": "stage",
        "image": "registry.example/omnimodel/runtime:1.0",
        "imageID": "",
        "ready": False,
        "restartCount": 0,
        "started": False,
        "lastState": {},
    }
    return {
        "metadata": meta,
        "status": {
            "phase": "Running" if container.get("state", {}).get("running") else "Pending",
            "containerStatuses": [{**base, **container}],
        },
    }


_TERMINATED_OOM = {
    "exitCode": 137,
    "reason": "OOMKilled",
    "startedAt": "2026-01-01T00:00:05Z",
    "finishedAt": "2026-01-01T00:00:20Z",
    "containerID": "containerd://4f1c",
}
_PULL = (
    'Failed to pull image "registry.example/omnimodel/runtime:nope": rpc error: code = NotFound desc = failed to pull '
    'and unpack image "registry.example/omnimodel/runtime:nope": failed to resolve reference '
    '"registry.example/omnimodel/runtime:nope": registry.example/omnimodel/runtime:nope: not found'
)
_BACKOFF = (
    "back-off 1m20s restarting failed container=stage "
    "pod=m-thinker-7c9d8b6f5-x2x7q_ml(0f9c4c1e-7d1e-4a53-9c55-3b8e0f0c2d11)"
)
_RAISED = "FileNotFoundError: no weights for stage thinker under /models/hf/hub (model.cache is empty)"
_TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "/opt/omnimodel/lib/python3.11/site-packages/omnimodel_runtime/cli.py", line 412, in main\n'
    "    return command(args)\n"
    f"{_RAISED}\n"
)
_SETTING = (
    "2026-12-07 17:09:39,733 INFO omnimodel_runtime.cli: threads: 2 (affinity 32, cgroup quota 2)\n"
    "omnimodel stage: 1 validation error for RuntimeSettings\n"
    "max_batch_size\n"
    "  Input should be a valid integer, unable to parse string as an integer [type=int_parsing, "
    "input_value='zero', input_type=str]\n"
    "    For further information visit https://errors.pydantic.dev/2.14/v/int_parsing\n"
)
CONTAINER_TROUBLE = {
    "ErrImagePull": (
        {
            "image": "registry.example/omnimodel/runtime:nope",
            "state": {"waiting": {"reason": "ErrImagePull", "message": _PULL}},
        },
        f"container stage: ErrImagePull: {_PULL}",
    ),
    "ImagePullBackOff": (
        {
            "image": "registry.example/omnimodel/runtime:nope",
            "state": {
                "waiting": {
                    "reason": "ImagePullBackOff",
                    "message": 'Back-off pulling image "registry.example/omnimodel/runtime:nope"',
                }
            },
        },
        'container stage: ImagePullBackOff: Back-off pulling image "registry.example/omnimodel/runtime:nope"',
    ),
    "CrashLoopBackOff": (
        {
            "restartCount": 4,
            "state": {"waiting": {"reason": "CrashLoopBackOff", "message": _BACKOFF}},
            "lastState": {"terminated": {**_TERMINATED_OOM, "exitCode": 1, "reason": "Error"}},
        },
        f"container stage: CrashLoopBackOff: {_BACKOFF}; last terminated Error (exit code 1)",
    ),
    "OOMKilled, backing off": (
        {
            "restartCount": 2,
            "state": {"waiting": {"reason": "CrashLoopBackOff", "message": _BACKOFF}},
            "lastState": {"terminated": _TERMINATED_OOM},
        },
        f"container stage: CrashLoopBackOff: {_BACKOFF}; last terminated OOMKilled (exit code 137)",
    ),
    "crashed, its log's last line": (
        {
            "restartCount": 3,
            "state": {"waiting": {"reason": "CrashLoopBackOff", "message": _BACKOFF}},
            "lastState": {
                "terminated": {
                    **_TERMINATED_OOM,
                    "exitCode": 1,
                    "reason": "Error",
                    # terminationMessagePolicy FallbackToLogsOnError: the log's tail.
                    "message": _TRACEBACK,
                }
            },
        },
        f"container stage: CrashLoopBackOff: {_BACKOFF}; last terminated Error (exit code 1): {_RAISED}",
    ),
    # What `omnimodel stage` prints for a setting it cannot read: the error's first line and its details.
    "exited on a bad setting": (
        {"state": {"terminated": {**_TERMINATED_OOM, "exitCode": 2, "reason": "Error", "message": _SETTING}}},
        "container stage: last terminated Error (exit code 2): omnimodel stage: 1 validation error for "
        "RuntimeSettings max_batch_size Input should be a valid integer, unable to parse string as an integer "
        "[type=int_parsing, input_value='zero', input_type=str] For further information visit "
        "https://errors.pydantic.dev/2.14/v/int_parsing",
    ),
    "OOMKilled, restarted": (
        {
            "restartCount": 1,
            "started": True,
            "state": {"running": {"startedAt": "2026-01-01T00:00:21Z"}},
            "lastState": {"terminated": _TERMINATED_OOM},
        },
        "container stage: last terminated OOMKilled (exit code 137)",
    ),
}


@pytest.mark.parametrize("trouble", CONTAINER_TROUBLE)
def test_what_the_kubelet_says_of_a_stage_container_reaches_ready(trouble: str) -> None:
    container, said = CONTAINER_TROUBLE[trouble]
    thinker = component_state("thinker", deployment(1, updated=1, available=0, conditions=UPDATED), [_pod(container)])
    status = roll_up(thinker, ready("talker"), ready("code2wav"))
    assert conditions(status)[cond.READY] == ("False", cond.PODS_NOT_READY)
    assert _ready_condition(status).message == f"thinker: 0/1 pods available ({said})"
    assert status.stages[0].message == f"thinker: 0/1 pods available ({said})"  # type: ignore[index]


def test_a_rollout_stuck_on_an_image_pull_says_so_while_the_old_pod_serves() -> None:
    """A new image that does not exist: the new pod backs off, the old one keeps serving (2 pods for 1)."""
    container, said = CONTAINER_TROUBLE["ImagePullBackOff"]
    old = {"ready": True, "started": True, "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}}
    pods = [_pod(old), _pod(container)]
    thinker = component_state("thinker", deployment(1, updated=1, available=1, total=2, conditions=UPDATED), pods)
    assert (thinker.reason, thinker.message) == (cond.PODS_NOT_READY, f"thinker: 1/1 pods available ({said})")


def test_an_old_pod_stopping_in_a_rollout_is_no_trouble() -> None:
    """SIGTERM ends an old pod's container with exit code 143: that is a rollout, not a failure."""
    stopped = {"state": {"terminated": {**_TERMINATED_OOM, "exitCode": 143, "reason": "Error"}}}
    thinker = component_state(
        "thinker", deployment(1, updated=1, available=1, total=2, conditions=UPDATED), [_pod(stopped, deleting=True)]
    )
    assert thinker.reason == cond.UPDATING


def test_an_unschedulable_first_rollout_is_insufficient_capacity_with_the_schedulers_words() -> None:
    said = (
        "0/7 nodes are available: 7 Insufficient cpu. preemption: 0/7 nodes are available: "
        "7 No preemption victims found for incoming pod."
    )
    pod = {
        "metadata": {"name": "m-thinker-7c9d8b6f5-x2x7q"},
        "status": {
            "phase": "Pending",
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": said,
                    "lastProbeTime": None,
                    "lastTransitionTime": "2026-01-01T00:00:00Z",
                }
            ],
        },
    }
    thinker = component_state("thinker", deployment(1, updated=1, available=0, conditions=UPDATED), [pod])
    status = roll_up(thinker, ready("talker"), ready("code2wav"))
    assert conditions(status)[cond.READY] == ("False", cond.INSUFFICIENT_CAPACITY)
    assert _ready_condition(status).message == f"thinker: pods cannot be scheduled: {said}"
