"""Condition transitions from child state: the cases that used to flap or lie, one by one."""

from __future__ import annotations

from typing import Any

import pytest

from omnimodel_operator import conditions as cond
from omnimodel_operator.api.v1alpha1 import OmniModelStatus
from omnimodel_operator.resolve import Plan, resolve
from omnimodel_operator.settings import OperatorSettings
from omnimodel_operator.status import ComponentState, Problems, component_state, compute_status

SETTINGS = OperatorSettings()
NOW = "2026-01-01T00:00:00Z"


def plan() -> Plan:
    spec = {"model": {"source": "tiny://qwen2.5-omni"}, "preset": "qwen2.5-omni"}
    return resolve("m", "ml", spec, SETTINGS, uid="u")


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
    wakeable = resolve("m", "ml", spec, SETTINGS, uid="u")
    talker = component_state("talker", deployment(0, updated=0, available=0), [])
    status = compute_status(wakeable, [ready("thinker"), talker, ready("code2wav")], ready("gateway"), {},
                            OmniModelStatus(), 2, NOW, Problems())  # fmt: skip
    assert conditions(status)[cond.READY] == ("True", cond.ALL_READY)
    assert "talker idle at 0 replicas" in next(c.message for c in status.conditions or () if c.type == cond.READY)
    assert status.served_modalities == ["text", "audio"]
    assert status.stages[1].reason == cond.SCALED_TO_ZERO  # type: ignore[index]
