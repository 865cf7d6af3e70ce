"""The autoscaling decision, pure: signals and history in, replicas and a reason out.

Per stage, like the HorizontalPodAutoscaler: ``ceil(load / target)`` bounded by min/max, scale-ups
stabilised over ``scaleUpWindowSeconds`` (lowest recommendation of the window) and scale-downs over
``scaleDownWindowSeconds`` (highest), so a single sample neither adds nor removes a pod. Beyond it, for
a stage graph:

- **Bottleneck first.** Of the stages that want more replicas, one grows per decision: the one with
  the highest load per replica relative to its target. The others wait a decision; their load is often
  the bottleneck's backlog, and the cluster's devices go where they help.
- **Ratios.** A stage can be held within min..max times another stage's replicas.
- **Zero.** With ``minReplicas: 0`` a stage without load for ``idleSecondsToZero`` goes to 0; any load
  (requests the gateway holds for it count) brings it back to at least 1 at once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from omnimodel_operator.api.v1alpha1 import Autoscaling

# History kept per stage: long enough for the longest window the API allows.
HISTORY_SECONDS: Final = 3600.0


@dataclass(frozen=True)
class StageSignal:
    """One stage's load at one instant, in the units of its metric, summed over its replicas."""

    load: float
    # Requests waiting for a replica that does not exist yet (a stage at zero): always wakes the stage.
    waiting: int = 0


@dataclass
class StageHistory:
    """What a stage's past decisions need: recommendations with their time, and the last load."""

    recommendations: list[tuple[float, int]] = field(default_factory=list)
    last_load_at: float | None = None

    def record(self, now: float, recommended: int, load: float) -> None:
        self.recommendations.append((now, recommended))
        cutoff = now - HISTORY_SECONDS
        self.recommendations = [(t, r) for t, r in self.recommendations if t >= cutoff]
        if load > 0:
            self.last_load_at = now

    def within(self, now: float, seconds: float) -> list[int]:
        return [r for t, r in self.recommendations if t >= now - seconds]


@dataclass(frozen=True)
class Decision:
    stage: str
    current: int
    desired: int
    signal: float
    reason: str

    @property
    def changes(self) -> bool:
        return self.desired != self.current


def _raw(auto: Autoscaling, target: float, signal: StageSignal) -> tuple[int, str]:
    need = math.ceil(signal.load / target - 1e-9) if signal.load > 0 else 0
    if signal.waiting and need < 1:
        need = 1
    bounded = max(auto.min_replicas, min(auto.max_replicas, need))
    why = f"load {signal.load:g} for a target of {target:g} per replica needs {need}"
    if signal.waiting:
        why += f" ({signal.waiting} request(s) waiting for a replica)"
    if bounded != need:
        why += f", bounded to {bounded} (min {auto.min_replicas}, max {auto.max_replicas})"
    return bounded, why


def decide_stage(
    stage: str,
    auto: Autoscaling,
    target: float,
    signal: StageSignal,
    current: int,
    history: StageHistory,
    now: float,
) -> Decision:
    """The stage's own recommendation, stabilised; the graph rules come after (:func:`decide`)."""
    raw, why = _raw(auto, target, signal)
    history.record(now, raw, signal.load + signal.waiting)
    if raw > current:
        window = history.within(now, auto.scale_up_window_seconds)
        desired = max(current, min(window)) if signal.waiting == 0 else max(raw, 1)
        if desired < raw:
            why += f"; held at {desired} by the {auto.scale_up_window_seconds}s scale-up window"
        return Decision(stage, current, desired, signal.load, why)
    if raw < current:
        window = history.within(now, auto.scale_down_window_seconds)
        desired = min(current, max(window))
        if desired == 0 and history.last_load_at is not None and now - history.last_load_at < auto.idle_seconds_to_zero:
            desired = min(current, 1)
            why += f"; kept at {desired} until {auto.idle_seconds_to_zero}s without load"
        elif desired > raw:
            why += f"; held at {desired} by the {auto.scale_down_window_seconds}s scale-down window"
        return Decision(stage, current, desired, signal.load, why)
    return Decision(stage, current, current, signal.load, why)


def _ratio_bounds(auto: Autoscaling, replicas: Mapping[str, int]) -> tuple[int, int] | None:
    if auto.ratio is None or auto.ratio.stage not in replicas:
        return None
    other = replicas[auto.ratio.stage]
    low = math.ceil(auto.ratio.min * other - 1e-9) if auto.ratio.min is not None else 0
    high = math.floor(auto.ratio.max * other + 1e-9) if auto.ratio.max is not None else 1 << 30
    return low, high


def decide(
    stages: Sequence[tuple[str, Autoscaling, float]],
    signals: Mapping[str, StageSignal],
    current: Mapping[str, int],
    histories: Mapping[str, StageHistory],
    now: float,
) -> list[Decision]:
    """Decisions for every autoscaled stage of one OmniModel (name, spec, resolved target each)."""
    own = [
        decide_stage(name, auto, target, signals.get(name, StageSignal(0.0)), current[name], histories[name], now)
        for name, auto, target in stages
    ]
    pressure = {
        d.stage: (signals.get(d.stage, StageSignal(0.0)).load / max(target, 1e-9)) / max(d.current, 1)
        for d, (_, _, target) in zip(own, stages, strict=True)
    }
    ups = sorted((d for d in own if d.desired > d.current), key=lambda d: -pressure[d.stage])
    # A stage that has requests waiting for it (it is at zero) always wakes: nothing is served without it.
    first = {d.stage for d in ups if signals.get(d.stage, StageSignal(0.0)).waiting} or {d.stage for d in ups[:1]}
    out: list[Decision] = []
    for d in own:
        if d.desired > d.current and d.stage not in first:
            why = d.reason + f"; waits: {ups[0].stage} is the bottleneck"
            out.append(Decision(d.stage, d.current, d.current, d.signal, why))
        else:
            out.append(d)
    replicas = {**current, **{d.stage: d.desired for d in out}}
    final: list[Decision] = []
    for d, (_, auto, _) in zip(out, stages, strict=True):
        bounds = _ratio_bounds(auto, replicas)
        clamped = d.desired
        if bounds is not None:
            clamped = max(auto.min_replicas, min(auto.max_replicas, max(bounds[0], min(bounds[1], d.desired))))
        if clamped != d.desired and auto.ratio is not None:
            why = d.reason + f"; {clamped} keeps the ratio to {auto.ratio.stage} ({replicas[auto.ratio.stage]})"
            final.append(Decision(d.stage, d.current, clamped, d.signal, why))
        else:
            final.append(d)
    return final
