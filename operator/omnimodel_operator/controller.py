"""The controller: a work queue of OmniModels fed by watch events, reconciled from a watch-fed cache.

kopf's watch streams keep an in-memory copy of every OmniModel and of everything the operator owns
(kopf indexes, see :mod:`omnimodel_operator.handlers`), and their event handlers call
:meth:`Controller.enqueue`. Workers take one OmniModel at a time from the queue and run
:func:`~omnimodel_operator.reconcile.reconcile` against that copy, so:

- drift is repaired within the event's round trip (an edited, scaled or deleted child is an event on
  a watched object), not on the next periodic pass;
- steady-state API traffic is the watch streams alone: a pass that finds nothing to change sends no
  request, so the periodic pass (``OMNIMODEL_RESYNC_INTERVAL``) is a cheap safety net;
- one OmniModel is never reconciled twice at once, events that arrive while it is being reconciled
  queue exactly one more pass, and a burst of child events coalesces into one pass;
- a failing OmniModel backs off exponentially and never holds up the others.

The queue follows client-go's workqueue (dirty/processing sets, per-key rate limiting).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any, Generic, Literal, Protocol, TypeVar

from omnimodel_operator.api.v1alpha1 import AutoscalerStatus
from omnimodel_operator.kube import ApiError, KubeClient, Manifest
from omnimodel_operator.metrics import InstrumentedKube, OperatorMetrics, ReadyStatus, Trigger, ready_of
from omnimodel_operator.observed import Observed
from omnimodel_operator.reconcile import Outcome, reconcile, utc_now
from omnimodel_operator.settings import OperatorSettings

__all__ = ["Cache", "Controller", "WorkQueue"]

Key = tuple[str, str]  # (namespace, name) of an OmniModel
K = TypeVar("K", bound=Hashable)
Logger = logging.Logger | logging.LoggerAdapter[Any]
log = logging.getLogger("omnimodel_operator")


class WorkQueue(Generic[K]):
    """client-go's workqueue on asyncio.

    A key is queued at most once. A key added while a worker processes it is queued again when the
    worker calls :meth:`done`, so it is never processed concurrently and no event is lost. Delayed adds
    keep the earliest due time (a burst of events becomes one pass). :meth:`add_rate_limited` delays by
    ``base * 2**failures`` up to ``cap``; :meth:`forget` resets that after a success.
    """

    def __init__(self, base_delay: float = 0.5, max_delay: float = 300.0) -> None:
        self._queue: deque[K] = deque()
        self._queued: set[K] = set()
        self._processing: set[K] = set()
        self._dirty: set[K] = set()
        self._timers: dict[K, tuple[float, asyncio.TimerHandle]] = {}
        self._failures: dict[K, int] = {}
        self._ready = asyncio.Event()
        self._base = base_delay
        self._cap = max_delay

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, key: K, delay: float = 0.0) -> None:
        if delay > 0:
            due = time.monotonic() + delay
            pending = self._timers.get(key)
            if pending is not None and pending[0] <= due:
                return
            if pending is not None:
                pending[1].cancel()
            handle = asyncio.get_running_loop().call_later(delay, self._fire, key)
            self._timers[key] = (due, handle)
            return
        pending = self._timers.pop(key, None)
        if pending is not None:
            pending[1].cancel()
        if key in self._processing:
            self._dirty.add(key)
        elif key not in self._queued:
            self._queued.add(key)
            self._queue.append(key)
            self._ready.set()

    def _fire(self, key: K) -> None:
        self._timers.pop(key, None)
        self.add(key)

    def add_rate_limited(self, key: K) -> float:
        failures = self._failures.get(key, 0)
        self._failures[key] = failures + 1
        delay = float(min(self._cap, self._base * 2.0**failures))
        self.add(key, delay)
        return delay

    def forget(self, key: K) -> None:
        self._failures.pop(key, None)

    def discard(self, key: K) -> None:
        """Drop pending delayed adds and the failure count (the object is gone)."""
        pending = self._timers.pop(key, None)
        if pending is not None:
            pending[1].cancel()
        self._failures.pop(key, None)

    async def get(self) -> K:
        while not self._queue:
            self._ready.clear()
            await self._ready.wait()
        key = self._queue.popleft()
        self._queued.discard(key)
        self._processing.add(key)
        return key

    def done(self, key: K) -> None:
        self._processing.discard(key)
        if key in self._dirty:
            self._dirty.discard(key)
            self.add(key)

    def close(self) -> None:
        for _, handle in self._timers.values():
            handle.cancel()
        self._timers.clear()


class Cache(Protocol):
    """The watch-fed copy of the cluster the controller reads (kopf indexes in production)."""

    def omnimodel(self, namespace: str, name: str) -> Manifest | None: ...

    def observed(self, namespace: str, name: str) -> Observed: ...

    def omnimodel_keys(self) -> Iterable[Key]: ...

    def owners(self, namespace: str, instance: str) -> Iterable[str]:
        """Names of OmniModels whose children carry this instance label."""
        ...


Reason = Literal["omnimodel", "child", "resync", "retry", "autoscaler", "weights"]


class Controller:
    """Work queue + workers + the periodic safety-net pass, over one client and one cache."""

    def __init__(
        self,
        client: KubeClient,
        cache: Cache,
        settings: OperatorSettings,
        metrics: OperatorMetrics,
        *,
        logger: Logger = log,
        now: Callable[[], str] = utc_now,
    ) -> None:
        self.client = InstrumentedKube(client, metrics)
        self.cache = cache
        self.settings = settings
        self.metrics = metrics
        self.queue: WorkQueue[Key] = WorkQueue(settings.retry_base_delay, settings.retry_max_delay)
        self.logger = logger
        self._now = now
        # Why each queued key is queued (the first reason wins until it is processed), for metrics.
        self._why: dict[Key, Reason] = {}
        # The status this operator last wrote, per OmniModel uid (see reconcile's last_status).
        self._written: dict[Key, tuple[str | None, dict[str, Any]]] = {}
        self._ready: dict[Key, ReadyStatus] = {}
        # Autoscaling decisions per OmniModel, shown in status (set when the autoscaler runs).
        self.autoscaler_status: Callable[[Key], Mapping[str, AutoscalerStatus]] = lambda key: {}
        # The running fetch's last /progress per OmniModel, shown in status.weights.
        self.weights_progress: Callable[[Key], Mapping[str, Any] | None] = lambda key: None
        self._idle = asyncio.Event()
        self._idle.set()
        self._busy = 0

    # feeding the queue ------------------------------------------------------------------------
    def enqueue(self, key: Key, reason: Reason, delay: float = 0.0) -> None:
        self._why.setdefault(key, reason)
        self.queue.add(key, delay)
        self._idle.clear()
        self.metrics.queue_depth.set(len(self.queue))

    def on_omnimodel(self, namespace: str, name: str, event_type: str | None) -> None:
        key = (namespace, name)
        if event_type == "DELETED":
            self.queue.discard(key)
            self._written.pop(key, None)
            self._ready.pop(key, None)
            self._report_ready()
            return
        self.enqueue(key, "omnimodel")

    def on_child(self, namespace: str, owner: str | None, instance: str | None) -> None:
        """A child (or pod) changed: reconcile its OmniModel after a short coalescing delay, so a
        rollout's burst of Deployment, ReplicaSet-driven pod and status events costs one pass."""
        names = [owner] if owner else list(self.cache.owners(namespace, instance or ""))
        for name in names:
            self.enqueue((namespace, name), "child", self.settings.event_coalesce_seconds)

    def resync(self) -> int:
        keys = list(self.cache.omnimodel_keys())
        for key in keys:
            self.enqueue(key, "resync")
        return len(keys)

    # running ------------------------------------------------------------------------------------
    async def run(self) -> None:
        """Workers and the resync timer, until cancelled."""
        tasks = [asyncio.create_task(self._worker()) for _ in range(self.settings.workers)]
        tasks.append(asyncio.create_task(self._resync_forever()))
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.queue.close()

    async def wait_idle(self) -> None:
        """Until nothing is queued or running (tests; delayed retries do not count)."""
        await self._idle.wait()

    async def _resync_forever(self) -> None:
        while True:
            # Pacing, not synchronisation: the safety-net pass is due one interval after the last.
            await asyncio.sleep(self.settings.resync_interval)
            self.resync()

    async def _worker(self) -> None:
        while True:
            key = await self.queue.get()
            self._busy += 1
            self.metrics.queue_depth.set(len(self.queue))
            try:
                await self.process(key, self._why.pop(key, "retry"))
            finally:
                self._busy -= 1
                self.queue.done(key)
                if not len(self.queue) and not self._busy:
                    self._idle.set()

    async def process(self, key: Key, reason: Reason) -> Outcome | None:
        """One reconcile of one OmniModel; never raises (failures back off and are logged)."""
        namespace, name = key
        body = self.cache.omnimodel(namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            self.queue.discard(key)
            return None
        uid = body["metadata"].get("uid")
        written = self._written.get(key)
        last = written[1] if written is not None and written[0] == uid else None
        trigger: Trigger = reason
        try:
            with self.metrics.reconcile_pass(trigger) as record:
                outcome = await reconcile(
                    self.client, body, self.cache.observed(namespace, name), self.settings, self._now,
                    last_status=last, autoscalers=self.autoscaler_status(key),
                    weights_progress=self.weights_progress(key),
                )  # fmt: skip
                record.finished(outcome)
        except ApiError as err:
            if err.status == 404:  # deleted while we worked; garbage collection does the rest
                self.logger.debug(f"Stopped reconciling OmniModel {namespace}/{name}: {err}")
                self.queue.discard(key)
                return None
            delay = self.queue.add_rate_limited(key)
            self.logger.warning(f"Reconcile of OmniModel {namespace}/{name} failed, retrying in {delay:.1f}s: {err}")
            return None
        except Exception:
            delay = self.queue.add_rate_limited(key)
            self.logger.exception(f"Reconcile of OmniModel {namespace}/{name} crashed, retrying in {delay:.1f}s")
            return None
        self._written[key] = (uid, outcome.status)
        self._ready[key] = ready_of(outcome.status)
        self._report_ready()
        self._log(namespace, name, outcome)
        if outcome.errors:
            delay = self.queue.add_rate_limited(key)
            self.logger.warning(
                f"OmniModel {namespace}/{name}: the API server refused {len(outcome.errors)} child(ren), "
                f"retrying in {delay:.1f}s: {'; '.join(outcome.errors)}"
            )
        else:
            self.queue.forget(key)
        if outcome.recheck_after is not None:
            self.enqueue(key, "retry", outcome.recheck_after)
        return outcome

    def _report_ready(self) -> None:
        self.metrics.set_omnimodels(Counter(self._ready.values()))

    def _log(self, namespace: str, name: str, outcome: Outcome) -> None:
        for ref in outcome.applied:
            self.logger.info(f"Applied {ref}")
        for ref in outcome.deleted:
            self.logger.info(f"Deleted {ref}")
        if outcome.invalid is not None:
            self.logger.warning(f"OmniModel {namespace}/{name} has an invalid spec, nothing applied: {outcome.invalid}")
        for conflict in outcome.conflicts:
            self.logger.warning(f"OmniModel {namespace}/{name}: name conflict, nothing applied: {conflict}")
