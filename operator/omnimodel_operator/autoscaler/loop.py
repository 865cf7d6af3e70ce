"""Running the autoscaler: every ``OMNIMODEL_AUTOSCALE_INTERVAL`` seconds, for each OmniModel with a
stage on ``provider: operator``, read the signals, decide, and set replicas through the Deployment's
scale subresource (its own field manager, so the operator's server-side apply, which leaves
``replicas`` out for these stages, never fights it). A decision that changes replicas posts an Event
and queues the OmniModel so its status shows it. Stages without ``autoscaling`` are never touched.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Final, Protocol

import httpx

from omnimodel_operator import constants as C
from omnimodel_operator.api.v1alpha1 import AutoscalerStatus
from omnimodel_operator.autoscaler.decide import Decision, StageHistory, StageSignal, decide
from omnimodel_operator.autoscaler.signals import Readings, read
from omnimodel_operator.kube import ApiError, KubeClient, Manifest
from omnimodel_operator.observed import Observed
from omnimodel_operator.reconcile import event, utc_now
from omnimodel_operator.runtimes import Scaled, resolve
from omnimodel_operator.settings import OperatorSettings
from omnimodel_operator.spec import InvalidSpec

Key = tuple[str, str]
FIELD_MANAGER: Final = "omnimodel-autoscaler"
log = logging.getLogger("omnimodel_operator")


class Source(Protocol):
    """What the autoscaler reads: the controller's cache."""

    def omnimodel(self, namespace: str, name: str) -> Manifest | None: ...

    def observed(self, namespace: str, name: str) -> Observed: ...

    def omnimodel_keys(self) -> Any: ...


def signal_of(scaled: Scaled, readings: Readings) -> StageSignal:
    waiting = int(readings.waiting.get(scaled.stage, 0))
    if scaled.metric == "queueDepth":
        return StageSignal(readings.queue.get(scaled.stage, 0.0), waiting)
    in_flight = readings.in_flight.get(scaled.stage, 0.0)
    if scaled.metric == "pendingSeconds":
        # Work waiting, in seconds: what is in flight times what one request takes there (1 s until
        # the gateway has timed one).
        return StageSignal(in_flight * (readings.mean_seconds(scaled.stage) or 1.0), waiting)
    return StageSignal(in_flight, waiting)


class Autoscaler:
    def __init__(
        self,
        client: KubeClient,
        source: Source,
        settings: OperatorSettings,
        *,
        on_decision: Callable[[Key], None] = lambda key: None,
        clock: Callable[[], float] = time.monotonic,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        self.client = client
        self.source = source
        self.settings = settings
        self.on_decision = on_decision
        self.clock = clock
        self.http = http or httpx.AsyncClient(timeout=settings.autoscale_scrape_timeout)
        self._histories: dict[tuple[Key, str], StageHistory] = {}
        # Per autoscaled stage: the gateways' busy seconds (in flight integrated over time) at the last
        # decision, and when it was read.
        self._busy: dict[tuple[Key, str], tuple[float, float]] = {}
        self._status: dict[Key, dict[str, AutoscalerStatus]] = {}

    def status_of(self, key: Key) -> Mapping[str, AutoscalerStatus]:
        """The last decision per autoscaled stage, for the OmniModel's status."""
        return self._status.get(key, {})

    async def run(self) -> None:
        while True:
            # Pacing, not synchronisation: one round of decisions per interval.
            await asyncio.sleep(self.settings.autoscale_interval)
            await self.once()

    async def once(self) -> None:
        keys = list(self.source.omnimodel_keys())
        await asyncio.gather(*(self._one(key) for key in keys))

    async def _one(self, key: Key) -> None:
        try:
            await self.scale(key)
        except Exception:
            log.exception(f"Autoscaling OmniModel {key[0]}/{key[1]} failed")
        try:
            await self.membership(key)
        except Exception:
            log.exception(f"Reading the vLLM-Omni head of OmniModel {key[0]}/{key[1]} failed")

    async def membership(self, key: Key) -> None:
        """What the runtime reads from its live pods before scaling (``Runtime.observe``; vLLM-Omni: which
        replica pods the head routes to, so a scale-down never counts a replica the head has dropped)."""
        namespace, name = key
        body = self.source.omnimodel(namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return
        try:
            runtime = resolve(name, namespace, body.get("spec") or {}, self.settings, uid=body["metadata"].get("uid"))
        except InvalidSpec:
            return
        await runtime.observe(self.client, self.http, self.source.observed(namespace, name))

    async def scale(self, key: Key) -> list[Decision]:
        namespace, name = key
        body = self.source.omnimodel(namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            self._status.pop(key, None)
            return []
        try:
            runtime = resolve(name, namespace, body.get("spec") or {}, self.settings, uid=body["metadata"].get("uid"))
        except InvalidSpec:
            return []
        stages = runtime.autoscaled()
        if not stages:
            self._status.pop(key, None)
            return []
        observed = self.source.observed(namespace, name)
        scrape = runtime.scrape(stages)
        readings = await read(
            self.http, observed.pods, gateway_port=C.GATEWAY_PORT, stage_port=C.STAGE_PORT,
            stage_ids=scrape.stage_ids, scrape_stages=scrape.stages,
        )  # fmt: skip
        current: dict[str, int] = {}
        for s in stages:
            deployment = observed.objects.get(("Deployment", s.deployment))
            if deployment is None:
                return []  # not created yet: nothing to scale
            current[s.stage] = int((deployment.get("spec") or {}).get("replicas", 1))
        now = self.clock()
        histories = {
            s.stage: self._histories.setdefault((key, s.stage), StageHistory(last_load_at=now)) for s in stages
        }
        for s in stages:
            if s.metric in ("inFlight", "pendingSeconds"):
                mean = self._mean_in_flight((key, s.stage), readings, now)
                if mean is not None:
                    readings.in_flight[s.stage] = mean
        signals = {s.stage: signal_of(s, readings) for s in stages}
        decisions = decide([(s.stage, s.spec, s.target) for s in stages], signals, current, histories, now)
        if readings.errors:
            # Never drop capacity on missing data: a gateway that did not answer may be the loaded one.
            decisions = [d if d.desired >= d.current else Decision(d.stage, d.current, d.current, d.signal,
                         d.reason + f"; not scaling down: {len(readings.errors)} pod(s) did not report")
                         for d in decisions]  # fmt: skip
        by_stage = {s.stage: s for s in stages}
        changed = False
        statuses = dict(self._status.get(key, {}))
        for d in decisions:
            s = by_stage[d.stage]
            previous = statuses.get(d.stage)
            scaled_at = previous.last_scale_time if previous is not None else None
            if d.changes:
                try:
                    await self.client.scale("apps/v1", "Deployment", namespace, s.deployment, d.desired, FIELD_MANAGER)
                except ApiError as err:
                    log.warning(f"Scaling Deployment {namespace}/{s.deployment} to {d.desired} failed: {err}")
                    continue
                scaled_at = utc_now()
                changed = True
                log.info(f"Scaled Deployment {namespace}/{s.deployment} from {d.current} to {d.desired}: {d.reason}")
                await self._event(body, d, s)
            statuses[d.stage] = AutoscalerStatus(
                kind="OmniModelAutoscaler", name=s.deployment, current_replicas=d.current,
                desired_replicas=d.desired, metric=s.metric, signal=round(d.signal, 3), target=s.target,
                reason=d.reason, last_scale_time=scaled_at,
            )  # fmt: skip
        if statuses != self._status.get(key):
            self._status[key] = statuses
            changed = True
        if changed:
            self.on_decision(key)
        return decisions

    def _mean_in_flight(self, stage: tuple[Key, str], readings: Readings, now: float) -> float | None:
        """Requests in flight on the stage on average since the last decision (the rate of the gateways'
        busy seconds), or None to use the gauge's value at this instant: on the first reading, after a
        gateway restarted (the sum went down) or when a gateway did not answer (the sum is partial)."""
        busy = readings.busy_seconds.get(stage[1])
        if busy is None:
            self._busy.pop(stage, None)
            return None
        previous = self._busy.get(stage)
        self._busy[stage] = (busy, now)
        if previous is None or readings.errors or busy < previous[0] or now <= previous[1]:
            return None
        return (busy - previous[0]) / (now - previous[1])

    async def _event(self, body: Mapping[str, Any], d: Decision, s: Scaled) -> None:
        message = f"stage {d.stage}: {d.current} -> {d.desired} replicas ({d.reason})"
        try:
            await self.client.create(event(body, "Normal", "Scaled", message, utc_now()))
        except ApiError as err:
            log.debug(f"Event for {s.deployment} not posted: {err}")

    async def aclose(self) -> None:
        await self.http.aclose()
