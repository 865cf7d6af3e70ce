"""Prometheus metrics of stages and the gateway.

Each app owns a ``CollectorRegistry`` (not the global one), so several apps can live in one process
(``serve``, tests) without duplicate-registration errors. Metric names are a contract: the operator's
HPA reads ``omnimodel_queue_depth`` and ``omnimodel_requests_in_flight`` per pod.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Final, Protocol

from prometheus_client import CONTENT_TYPE_LATEST as PROMETHEUS_CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from omnimodel_runtime.errors import StageError
from omnimodel_runtime.protocol.stage import FinalFrame, ResponseFrame

__all__ = [
    "PROMETHEUS_CONTENT_TYPE",
    "GatewayMetrics",
    "StageMetrics",
    "StageMetricsFamily",
    "instrumented",
    "render",
]

_LATENCY_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_BATCH_BUCKETS: Final = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256)
# Window over which the tokens/s gauge averages.
_RATE_WINDOW_S: Final = 10.0


class _TokenRate:
    """Tokens per second over the last ``window`` seconds (thread-safe: engines report from workers)."""

    def __init__(self, window: float = _RATE_WINDOW_S) -> None:
        self._window = window
        self._events: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()

    def add(self, count: int) -> None:
        now = time.monotonic()
        with self._lock:
            self._events.append((now, count))
            self._trim(now)

    def rate(self) -> float:
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            return sum(c for _, c in self._events) / self._window

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self._window:
            self._events.popleft()


class EngineWork(Protocol):
    """An engine's load figures (:class:`omnimodel_runtime.engines.base.EngineWork`; this module sits below
    the engines, so it names their shape, not their class)."""

    @property
    def busy_seconds(self) -> float: ...
    @property
    def admitted(self) -> int: ...
    @property
    def queue_wait_seconds(self) -> float: ...


class _EngineWorkCollector(Collector):
    """``omnimodel_engine_busy_seconds_total``, ``omnimodel_engine_admitted_total`` and
    ``omnimodel_engine_queue_wait_seconds_total`` per stage, read from each engine at the scrape (its worker
    keeps them; engines that do not measure them have no series)."""

    def __init__(self) -> None:
        self.readers: dict[str, Callable[[], EngineWork | None]] = {}

    def collect(self) -> Iterable[Metric]:
        busy = CounterMetricFamily(
            "omnimodel_engine_busy_seconds",
            "Seconds the engine's worker spent in model calls (its rate is the stage's busy fraction)",
            labels=["stage"],
        )
        admitted = CounterMetricFamily(
            "omnimodel_engine_admitted", "Requests the engine's worker took from its queue", labels=["stage"]
        )
        wait = CounterMetricFamily(
            "omnimodel_engine_queue_wait_seconds",
            "Seconds those requests waited between submission and the worker taking them, summed",
            labels=["stage"],
        )
        for stage, read in sorted(self.readers.items()):
            work = read()
            if work is None:
                continue
            busy.add_metric([stage], work.busy_seconds)
            admitted.add_metric([stage], work.admitted)
            wait.add_metric([stage], work.queue_wait_seconds)
        yield from (busy, admitted, wait)


class StageMetricsFamily:
    """The stage metric families of one registry; every stage in the process is a label value
    (``serve`` runs several stages against one registry)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["stage"]
        self.queue = Gauge(
            "omnimodel_queue_depth", "Requests accepted by the engine but not started yet", labels, registry=registry
        )
        self.in_flight = Gauge(
            "omnimodel_requests_in_flight", "Requests the stage is working on", labels, registry=registry
        )
        self.requests = Counter(
            "omnimodel_stage_requests", "Finished stage requests by outcome", [*labels, "outcome"], registry=registry
        )
        self.latency = Histogram(
            "omnimodel_request_duration_seconds",
            "Stage request latency, first byte in to last frame out",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.ttft = Histogram(
            "omnimodel_time_to_first_token_seconds",
            "Time from request to its first output frame",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.tokens = Counter("omnimodel_generated_tokens", "Output tokens produced", labels, registry=registry)
        self.prompt_tokens = Counter("omnimodel_prompt_tokens", "Prompt tokens processed", labels, registry=registry)
        self.batch = Histogram(
            "omnimodel_batch_size",
            "Requests per engine forward pass",
            labels,
            buckets=_BATCH_BUCKETS,
            registry=registry,
        )
        self.tokens_per_second = Gauge(
            "omnimodel_generation_tokens_per_second",
            f"Output tokens per second over the last {_RATE_WINDOW_S:.0f} s",
            labels,
            registry=registry,
        )
        self.work = _EngineWorkCollector()
        registry.register(self.work)

    def for_stage(self, stage: str) -> StageMetrics:
        return StageMetrics(self, stage)


class StageMetrics:
    """Metrics of one stage; also the engine's :class:`~omnimodel_runtime.engines.base.EngineMetrics`."""

    def __init__(self, family: StageMetricsFamily | CollectorRegistry, stage: str) -> None:
        f = family if isinstance(family, StageMetricsFamily) else StageMetricsFamily(family)
        self.stage = stage
        self._queue = f.queue.labels(stage)
        self._in_flight = f.in_flight.labels(stage)
        self._requests = f.requests
        self._latency = f.latency.labels(stage)
        self._ttft = f.ttft.labels(stage)
        self._tokens = f.tokens.labels(stage)
        self._prompt_tokens = f.prompt_tokens.labels(stage)
        self._batch = f.batch.labels(stage)
        self._rate = _TokenRate()
        f.tokens_per_second.labels(stage).set_function(self._rate.rate)
        self._work = f.work

    def track_queue_depth(self, fn: Callable[[], int]) -> None:
        """Read the queue depth from the engine whenever metrics are scraped."""
        self._queue.set_function(fn)

    def track_work(self, fn: Callable[[], EngineWork | None]) -> None:
        """Read the engine's load figures (busy seconds, queue wait) whenever metrics are scraped."""
        self._work.readers[self.stage] = fn

    # EngineMetrics hooks (may be called from an engine's worker thread).
    def observe_batch(self, size: int) -> None:
        self._batch.observe(size)

    def add_generated_tokens(self, count: int) -> None:
        if count:
            self._tokens.inc(count)
            self._rate.add(count)

    # Request-level hooks (event loop).
    def request_started(self) -> None:
        self._in_flight.inc()

    def request_finished(self, *, outcome: str, duration: float, prompt_tokens: int) -> None:
        self._in_flight.dec()
        self._requests.labels(self.stage, outcome).inc()
        self._latency.observe(duration)
        if prompt_tokens:
            self._prompt_tokens.inc(prompt_tokens)

    def first_frame(self, seconds: float) -> None:
        self._ttft.observe(seconds)


async def instrumented(frames: AsyncIterator[ResponseFrame], metrics: StageMetrics) -> AsyncIterator[ResponseFrame]:
    """Record in-flight count, time to first frame, latency and outcome around an engine stream."""
    started = time.perf_counter()
    metrics.request_started()
    outcome, prompt_tokens, first = "cancelled", 0, True
    try:
        async for frame in frames:
            if first:
                metrics.first_frame(time.perf_counter() - started)
                first = False
            if isinstance(frame, FinalFrame):
                outcome, prompt_tokens = "ok", frame.usage.prompt_tokens
            yield frame
    except StageError as err:
        outcome = "rejected" if err.status < 500 else "error"
        raise
    except Exception:
        outcome = "error"
        raise
    finally:
        metrics.request_finished(outcome=outcome, duration=time.perf_counter() - started, prompt_tokens=prompt_tokens)


class GatewayMetrics:
    """Metrics of the OpenAI-facing gateway."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._requests = Counter(
            "omnimodel_http_requests", "API requests by route and status", ["route", "status"], registry=registry
        )
        self._latency = Histogram(
            "omnimodel_http_request_duration_seconds",
            "API request latency (streams: until the last chunk)",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self._in_flight = Gauge("omnimodel_gateway_requests_in_flight", "API requests being served", registry=registry)
        self._stage_up = Gauge(
            "omnimodel_stage_up", "1 when the stage has a healthy endpoint", ["stage"], registry=registry
        )

    def started(self) -> None:
        self._in_flight.inc()

    def finished(self, route: str, status: int, duration: float) -> None:
        self._in_flight.dec()
        self._requests.labels(route, str(status)).inc()
        self._latency.labels(route).observe(duration)

    def stage_up(self, stage: str, up: bool) -> None:
        self._stage_up.labels(stage).set(1 if up else 0)


class StageTraffic:
    """What the gateway sends each stage, as the operator's autoscaler reads it: requests in flight,
    requests held for a stage with no ready replica, and how long the stage took per request."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._in_flight = Gauge(
            "omnimodel_gateway_stage_in_flight",
            "Requests this gateway has sent to the stage and not seen finish",
            ["stage"],
            registry=registry,
        )
        self._waiting = Gauge(
            "omnimodel_gateway_stage_waiting",
            "Requests held because the stage has no ready replica (a stage at zero waking)",
            ["stage"],
            registry=registry,
        )
        self._seconds = Histogram(
            "omnimodel_gateway_stage_request_seconds",
            "Time the stage took per request, from sending it to its last frame",
            ["stage"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )

        # In flight integrated over time, per stage: [seconds so far, in flight now, since when]. Its
        # rate is the mean concurrency between two scrapes (Little's law), which the autoscaler uses
        # instead of the gauge's value at the instant of a scrape (noisy under short requests).
        self._busy: dict[str, list[float]] = {}
        registry.register(_BusySeconds(self._busy_now))

    def known(self, stage: str) -> None:
        """Expose the stage's series at 0 before its first request."""
        self._in_flight.labels(stage)
        self._waiting.labels(stage)
        self._seconds.labels(stage)
        self._busy.setdefault(stage, [0.0, 0.0, time.monotonic()])

    def _advance(self, stage: str, delta: int) -> None:
        now = time.monotonic()
        busy = self._busy.setdefault(stage, [0.0, 0.0, now])
        busy[0] += busy[1] * (now - busy[2])
        busy[1] += delta
        busy[2] = now

    def _busy_now(self) -> dict[str, float]:
        now = time.monotonic()
        return {stage: b[0] + b[1] * (now - b[2]) for stage, b in self._busy.items()}

    def sent(self, stage: str) -> None:
        self._in_flight.labels(stage).inc()
        self._advance(stage, 1)

    def finished(self, stage: str, seconds: float | None) -> None:
        """``seconds`` is None for a request that failed or was cancelled (it times nothing useful)."""
        self._in_flight.labels(stage).dec()
        self._advance(stage, -1)
        if seconds is not None:
            self._seconds.labels(stage).observe(seconds)

    def waiting(self, stage: str, count: int) -> None:
        self._waiting.labels(stage).set(count)


class _BusySeconds(Collector):
    """``omnimodel_gateway_stage_busy_seconds_total{stage}``, computed up to the moment of the scrape."""

    def __init__(self, read: Callable[[], dict[str, float]]) -> None:
        self._read = read

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily(
            "omnimodel_gateway_stage_busy_seconds",
            "Requests in flight on the stage integrated over time (its rate is the mean concurrency)",
            labels=["stage"],
        )
        for stage, seconds in sorted(self._read().items()):
            family.add_metric([stage], seconds)
        yield family


def render(registry: CollectorRegistry) -> bytes:
    """The registry in Prometheus text format."""
    return generate_latest(registry)
