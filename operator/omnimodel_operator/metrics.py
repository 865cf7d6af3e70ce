"""Prometheus metrics of the operator: reconcile passes and their duration, the work queue, API
requests (reads and writes), OmniModels by Ready.

:class:`OperatorMetrics` owns its ``CollectorRegistry`` (not the global one), so tests build their own
and read exact values, and nothing a library registers globally leaks into ``/metrics``. Requests are
counted by :class:`InstrumentedKube`, a :class:`~omnimodel_operator.kube.KubeClient` wrapper, so that
:func:`~omnimodel_operator.reconcile.reconcile` stays free of instrumentation. kopf's own watch streams
are not counted here (they are long-lived GETs, one per watched kind and namespace). Metric names and
label values are a contract with dashboards and alerts: change them only with both.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Final, Literal, get_args
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from omnimodel_operator import conditions as cond
from omnimodel_operator.kube import ApiError, KubeClient, Manifest
from omnimodel_operator.reconcile import Outcome

__all__ = [
    "InstrumentedKube",
    "MetricsServer",
    "OperatorMetrics",
    "ReconcilePass",
    "Result",
    "Trigger",
    "ready_counts",
    "ready_of",
]

# What queued a pass: an event on the OmniModel, an event on one of its children or pods, the periodic
# safety-net pass, a retry after a failure, or an autoscaling decision (its status).
Trigger = Literal["omnimodel", "child", "resync", "retry", "autoscaler", "weights"]
# How it ended. apply_error: the API server refused a child (status says which); name_conflict: a child's
# name is taken; not_found: the OmniModel was deleted while we worked; api_error: status could not be
# written; error: a bug, not the API server.
Result = Literal["ok", "invalid_spec", "apply_error", "name_conflict", "not_found", "api_error", "error"]
# A KubeClient request; `status` is the status subresource, `event` an Event. get/list are the only reads:
# everything else the operator reads comes from its watch-fed cache.
Verb = Literal["apply", "delete", "status", "event", "create", "get", "list", "scale"]
WRITE_VERBS: Final = ("apply", "delete", "status", "event", "create", "scale")
# The values of the Ready condition; Unknown also covers an OmniModel no pass has written status for yet.
ReadyStatus = Literal["True", "False", "Unknown"]

# A no-op pass reads the cache only (sub-millisecond); a first apply of a big pipeline is ~15 writes through
# a queue shared with every other reconcile, which can take seconds under load.
_DURATION_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


@dataclass
class ReconcilePass:
    """One pass being timed; the body sets ``result`` when it ends without an exception."""

    result: Result = "ok"

    def finished(self, outcome: Outcome) -> None:
        if outcome.invalid is not None:
            self.result = "invalid_spec"
        elif outcome.conflicts:
            self.result = "name_conflict"
        elif outcome.errors:
            self.result = "apply_error"
        else:
            self.result = "ok"


class OperatorMetrics:
    """The operator's metric families, in one registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.reconciles = Counter(
            "omnimodel_operator_reconciles",
            "Reconcile passes over one OmniModel, by what started them and how they ended",
            ["trigger", "result"],
            registry=self.registry,
        )
        self.reconcile_duration = Histogram(
            "omnimodel_operator_reconcile_duration_seconds",
            "Duration of one reconcile pass (time queued excluded), by what started it",
            ["trigger"],
            buckets=_DURATION_BUCKETS,
            registry=self.registry,
        )
        self.api_requests = Counter(
            "omnimodel_operator_api_requests",
            "Requests to the API server that it answered, by verb and kind (reads are get/list: the "
            "watch-fed cache answers the rest); a steady state adds none",
            ["verb", "kind"],
            registry=self.registry,
        )
        self.queue_depth = Gauge(
            "omnimodel_operator_queue_depth",
            "OmniModels waiting in the work queue for a reconcile pass",
            registry=self.registry,
        )
        self.omnimodels = Gauge(
            "omnimodel_operator_omnimodels",
            "OmniModels by the status of their Ready condition, as of their last reconcile pass",
            ["ready"],
            registry=self.registry,
        )
        # Zero series from the start: a rate() or an absent() alert needs them before the first event.
        for trigger in get_args(Trigger):
            self.reconcile_duration.labels(trigger)
            self.reconciles.labels(trigger, "ok")
        self.set_omnimodels(dict.fromkeys(get_args(ReadyStatus), 0))

    @contextmanager
    def reconcile_pass(self, trigger: Trigger) -> Iterator[ReconcilePass]:
        """Time one reconcile pass and count it by trigger and result.

        Exceptions are classified here and re-raised. A cancelled pass (operator shutdown) is not
        counted: it has no result.
        """
        record = ReconcilePass()
        started = time.perf_counter()
        try:
            yield record
        except ApiError as err:
            self._observe(trigger, "not_found" if err.status == 404 else "api_error", started)
            raise
        except Exception:
            self._observe(trigger, "error", started)
            raise
        self._observe(trigger, record.result, started)

    def _observe(self, trigger: Trigger, result: Result, started: float) -> None:
        self.reconciles.labels(trigger, result).inc()
        self.reconcile_duration.labels(trigger).observe(time.perf_counter() - started)

    def api_request(self, verb: Verb, kind: str) -> None:
        self.api_requests.labels(verb, kind).inc()

    def set_omnimodels(self, counts: Mapping[ReadyStatus, int]) -> None:
        """Replace every series, so a status nothing has any more drops to zero rather than going stale."""
        for ready in get_args(ReadyStatus):
            self.omnimodels.labels(ready).set(counts.get(ready, 0))


def ready_of(status: Mapping[str, Any] | None) -> ReadyStatus:
    """The Ready condition's status in a ``status`` object (None: never written)."""
    found = cond.find((status or {}).get("conditions"), cond.READY)
    value = found.get("status") if found is not None else None
    return "True" if value == "True" else "False" if value == "False" else "Unknown"


def ready_counts(statuses: Iterable[Mapping[str, Any] | None]) -> dict[ReadyStatus, int]:
    """OmniModels per Ready status, from their ``status`` objects (None: never written)."""
    counts: dict[ReadyStatus, int] = dict.fromkeys(get_args(ReadyStatus), 0)
    for status in statuses:
        counts[ready_of(status)] += 1
    return counts


class InstrumentedKube:
    """A :class:`KubeClient` that counts the requests the API server answered, by verb and kind.

    A request that fails raises before it is counted: the pass's result (and the condition it sets)
    records it.
    """

    def __init__(self, inner: KubeClient, metrics: OperatorMetrics) -> None:
        self._inner = inner
        self._metrics = metrics

    async def apply(self, manifest: Manifest, field_manager: str) -> Manifest:
        result = await self._inner.apply(manifest, field_manager)
        self._metrics.api_request("apply", manifest["kind"])
        return result

    async def list(self, api_version: str, kind: str, namespace: str, labels: Mapping[str, str]) -> list[Manifest]:
        result = await self._inner.list(api_version, kind, namespace, labels)
        self._metrics.api_request("list", kind)
        return result

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> Manifest | None:
        result = await self._inner.get(api_version, kind, namespace, name)
        self._metrics.api_request("get", kind)
        return result

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        await self._inner.delete(api_version, kind, namespace, name)
        self._metrics.api_request("delete", kind)

    async def patch_status(
        self, api_version: str, kind: str, namespace: str, name: str, status: Mapping[str, Any]
    ) -> Manifest:
        result = await self._inner.patch_status(api_version, kind, namespace, name, status)
        self._metrics.api_request("status", kind)
        return result

    async def scale(
        self, api_version: str, kind: str, namespace: str, name: str, replicas: int, field_manager: str
    ) -> Manifest:
        result = await self._inner.scale(api_version, kind, namespace, name, replicas, field_manager)
        self._metrics.api_request("scale", kind)
        return result

    async def create(self, manifest: Manifest) -> Manifest:
        result = await self._inner.create(manifest)
        kind = manifest["kind"]
        self._metrics.api_request("event" if kind == "Event" else "create", kind)
        return result


class MetricsServer:
    """``/metrics`` of one registry over HTTP, served from a daemon thread (prometheus_client's WSGI
    server), so a scrape never waits on the operator's event loop and a busy loop never fails a scrape.
    """

    def __init__(self, registry: CollectorRegistry, port: int, host: str = "0.0.0.0") -> None:
        # port 0 picks a free port (tests); the operator treats 0 as "disabled" and never gets here.
        server: WSGIServer
        thread: threading.Thread
        server, thread = start_http_server(port, host, registry)
        self._server = server
        self._thread = thread

    @property
    def port(self) -> int:
        port: int = self._server.server_port
        return port

    def close(self) -> None:
        """Stop serving and free the port; blocks up to the serve loop's poll interval (0.5 s)."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
