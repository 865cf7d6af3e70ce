"""The autoscaling decision on signal traces: targets and bounds, windows, zero and waking, bottleneck
first, ratios, and no flapping on a noisy load."""

from __future__ import annotations

import itertools
from typing import Any

from omnimodel_operator.api.v1alpha1 import Autoscaling
from omnimodel_operator.autoscaler.decide import Decision, StageHistory, StageSignal, decide

TICK = 10.0  # seconds between decisions


def auto(**fields: Any) -> Autoscaling:
    return Autoscaling.model_validate({"maxReplicas": 8, **fields})


def run(
    stages: dict[str, Autoscaling],
    trace: list[dict[str, float]],
    start: dict[str, int],
    waiting: list[dict[str, int]] | None = None,
    target: float = 4.0,
) -> list[dict[str, int]]:
    """Feed a load trace (one dict per tick) through decide(); replicas after each tick."""
    histories = {name: StageHistory(last_load_at=0.0) for name in stages}
    current = dict(start)
    out = []
    for i, loads in enumerate(trace):
        now = (i + 1) * TICK
        signals = {
            name: StageSignal(loads.get(name, 0.0), (waiting[i] if waiting else {}).get(name, 0)) for name in stages
        }
        decisions = decide([(n, a, target) for n, a in stages.items()], signals, current, histories, now)
        current = {d.stage: d.desired for d in decisions}
        out.append(dict(current))
    return out


def test_replicas_follow_load_over_target_within_bounds() -> None:
    out = run({"talker": auto(minReplicas=1, maxReplicas=4, scaleDownWindowSeconds=0)}, [
        {"talker": 3}, {"talker": 9}, {"talker": 30}, {"talker": 5}, {"talker": 0},
    ], {"talker": 1})  # fmt: skip
    assert [o["talker"] for o in out] == [1, 3, 4, 2, 1]


def test_scale_down_waits_for_the_window_and_scale_up_does_not() -> None:
    trace = [{"s": 16}, {"s": 0}, {"s": 0}, {"s": 0}, {"s": 0}, {"s": 0}]
    out = run({"s": auto(scaleDownWindowSeconds=30)}, trace, {"s": 1})
    # up at once to 4; the 4 stays until the 30 s window holds no recommendation above 1
    assert [o["s"] for o in out] == [4, 4, 4, 4, 1, 1]


def test_a_scale_up_window_ignores_a_single_spike() -> None:
    trace = [{"s": 4}, {"s": 40}, {"s": 4}, {"s": 40}, {"s": 40}, {"s": 40}]
    out = run({"s": auto(scaleUpWindowSeconds=20, scaleDownWindowSeconds=0)}, trace, {"s": 1})
    assert [o["s"] for o in out] == [1, 1, 1, 1, 1, 8]


def test_a_noisy_load_does_not_flap() -> None:
    noisy = [{"s": v} for v in (8, 9, 7, 8, 12, 6, 9, 8, 7, 9, 8, 10)]
    out = run({"s": auto(scaleDownWindowSeconds=60)}, noisy, {"s": 2})
    changes = sum(1 for a, b in itertools.pairwise(out) if a["s"] != b["s"])
    assert changes <= 1, out  # one step up to 3 on the 12, then held by the window
    assert max(o["s"] for o in out) == 3


def test_idle_stage_goes_to_zero_and_a_waiting_request_wakes_it_at_once() -> None:
    spec = auto(minReplicas=0, scaleDownWindowSeconds=0, idleSecondsToZero=30)
    trace = [{"talker": 4}, {}, {}, {}, {}, {}, {}]
    waits = [{}, {}, {}, {}, {}, {"talker": 1}, {}]
    out = run({"talker": spec}, trace, {"talker": 1}, waits)
    assert [o["talker"] for o in out] == [1, 1, 1, 0, 0, 1, 1]  # 30 s after the last load (t=10) it is 0


def test_bottleneck_first_one_stage_grows_per_decision() -> None:
    stages = {"thinker": auto(scaleDownWindowSeconds=600), "talker": auto(scaleDownWindowSeconds=600)}
    # the talker carries 5x its target per replica, the thinker 2x: the talker grows first
    out = run(stages, [{"thinker": 8, "talker": 20}, {"thinker": 8, "talker": 20}], {"thinker": 1, "talker": 1})
    assert out[0] == {"thinker": 1, "talker": 5}
    assert out[1] == {"thinker": 2, "talker": 5}


def test_a_woken_stage_does_not_wait_for_the_bottleneck() -> None:
    stages = {"thinker": auto(scaleDownWindowSeconds=600), "talker": auto(minReplicas=0)}
    out = run(stages, [{"thinker": 40}], {"thinker": 1, "talker": 0}, [{"talker": 2}])
    assert out[0] == {"thinker": 1, "talker": 1}


def test_ratio_bounds_hold_a_stage_to_another() -> None:
    stages = {
        "thinker": auto(maxReplicas=2, scaleDownWindowSeconds=0),
        "talker": auto(ratio={"stage": "thinker", "max": 2}, scaleDownWindowSeconds=0),
    }
    out = run(stages, [{"talker": 40}, {"talker": 40}], {"thinker": 1, "talker": 1})
    assert out[0]["talker"] == 2  # wants 8, at most 2 per thinker
    assert out[1]["talker"] == 2


def test_decision_reasons_name_load_target_and_what_held_it() -> None:
    histories = {"s": StageHistory(last_load_at=0.0)}
    (d,) = decide([("s", auto(scaleDownWindowSeconds=60), 4.0)], {"s": StageSignal(2.0)}, {"s": 3}, histories, 10.0)
    assert isinstance(d, Decision)
    assert "load 2 for a target of 4 per replica needs 1" in d.reason
