"""The operator's Prometheus metrics: passes by trigger and result, writes by verb, OmniModels by Ready,
the /metrics server and its kopf wiring. Reconciles run against the in-memory API server."""

from __future__ import annotations

import asyncio
import copy
import logging
import socket
from collections import Counter as Tally
from collections import defaultdict
from pathlib import Path
from typing import Any, cast

import httpx
import kopf
import pydantic
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from omnimodel_operator import handlers
from omnimodel_operator.kube import ApiError, FakeKube
from omnimodel_operator.metrics import CountingKube, MetricsServer, OperatorMetrics, ready_counts
from omnimodel_operator.reconcile import reconcile
from omnimodel_operator.settings import OperatorSettings

REPO = Path(__file__).parents[3]
SETTINGS = OperatorSettings()
LOGGER = logging.getLogger("test-metrics")


def example(name: str, namespace: str = "ml") -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((REPO / "examples" / name).read_text())
    doc["metadata"]["namespace"] = namespace
    return doc


def body(kube: FakeKube, name: str) -> dict[str, Any]:
    obj = kube.find("OmniModel", name, "ml")
    assert obj is not None
    return copy.deepcopy(obj)


def mark_rolled_out(kube: FakeKube) -> None:
    """What the deployment controller reports once every pod is updated and available."""
    for deploy in kube.of_kind("Deployment"):
        n = deploy["spec"].get("replicas", 1)
        kube.set_status(
            "Deployment",
            deploy["metadata"]["namespace"],
            deploy["metadata"]["name"],
            {
                "observedGeneration": deploy["metadata"]["generation"],
                "replicas": n,
                "readyReplicas": n,
                "updatedReplicas": n,
                "availableReplicas": n,
            },
        )


def value(metrics: OperatorMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def writes_by_verb(metrics: OperatorMetrics) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in metrics.registry.collect():
        if family.name == "omnimodel_operator_api_writes":
            for s in family.samples:
                if s.name.endswith("_total"):
                    out[s.labels["verb"]] = out.get(s.labels["verb"], 0.0) + s.value
    return out


def passes(metrics: OperatorMetrics, trigger: str, result: str = "ok") -> float:
    return value(metrics, "omnimodel_operator_reconciles_total", trigger=trigger, result=result)


@pytest.fixture
def metrics() -> OperatorMetrics:
    return OperatorMetrics()


@pytest.fixture
def kube() -> FakeKube:
    return FakeKube()


# ---------------------------------------------------------------------------------- writes (CountingKube)


async def test_writes_are_counted_by_verb_as_the_api_server_took_them(kube: FakeKube, metrics: OperatorMetrics) -> None:
    kube.put(example("qwen-omni.yaml"))
    outcome = await reconcile(CountingKube(kube, metrics), body(kube, "qwen-omni"), SETTINGS)
    by_verb = Tally(verb for verb, _, _ in kube.writes)
    assert writes_by_verb(metrics) == {
        "apply": len(outcome.applied),
        "status": 1,
        "event": by_verb["create"],  # the only objects reconcile creates are Events
    }
    assert by_verb["apply"] == len(outcome.applied) == 13
    deployments = sum(1 for verb, kind, _ in kube.writes if (verb, kind) == ("apply", "Deployment"))
    assert value(metrics, "omnimodel_operator_api_writes_total", verb="apply", kind="Deployment") == deployments == 4
    assert value(metrics, "omnimodel_operator_api_writes_total", verb="status", kind="OmniModel") == 1


async def test_a_no_op_pass_adds_no_write_counts(kube: FakeKube, metrics: OperatorMetrics) -> None:
    kube.put(example("qwen-omni.yaml"))
    client = CountingKube(kube, metrics)
    await reconcile(client, body(kube, "qwen-omni"), SETTINGS)
    mark_rolled_out(kube)
    await reconcile(client, body(kube, "qwen-omni"), SETTINGS)  # Ready: a status write and an event
    before = writes_by_verb(metrics)
    for status_only in (False, True):
        await reconcile(client, body(kube, "qwen-omni"), SETTINGS, status_only=status_only)
    assert writes_by_verb(metrics) == before


async def test_pruning_counts_deletes(kube: FakeKube, metrics: OperatorMetrics) -> None:
    doc = example("custom-graph.yaml")
    extra = {"name": "extra", "kind": "ar", "engine": "transformers", "task": "text-generation", "inputs": ["generate"]}
    doc["spec"]["stages"].append(extra)
    kube.put(doc)
    client = CountingKube(kube, metrics)
    await reconcile(client, body(kube, "custom-chat"), SETTINGS)
    assert "delete" not in writes_by_verb(metrics)
    om = kube.find("OmniModel", "custom-chat", "ml")
    assert om is not None
    om["spec"]["stages"].pop()  # its Deployment, Service and NetworkPolicy go
    outcome = await reconcile(client, body(kube, "custom-chat"), SETTINGS)
    assert len(outcome.deleted) == 3
    assert writes_by_verb(metrics)["delete"] == 3
    assert value(metrics, "omnimodel_operator_api_writes_total", verb="delete", kind="Deployment") == 1


class RefusingApply(FakeKube):
    """An API server that takes reads but refuses every apply (an admission webhook says no)."""

    async def apply(self, manifest: dict[str, Any], field_manager: str) -> dict[str, Any]:
        raise ApiError(422, "Invalid", "denied by webhook")


async def test_a_refused_write_is_not_counted(metrics: OperatorMetrics) -> None:
    kube = RefusingApply()
    kube.put(example("text-tiny.yaml"))
    with pytest.raises(ApiError):
        await reconcile(CountingKube(kube, metrics), body(kube, "text-tiny"), SETTINGS)
    assert writes_by_verb(metrics) == {}


# --------------------------------------------------------------------------------- passes and duration


@pytest.mark.parametrize(
    ("error", "result"),
    [
        (ApiError(404, "NotFound", "gone"), "not_found"),
        (ApiError(503, "", "busy"), "api_error"),
        (KeyError("x"), "error"),
    ],
)
def test_a_failed_pass_is_counted_by_cause_and_re_raised(
    metrics: OperatorMetrics, error: Exception, result: str
) -> None:
    with pytest.raises(type(error)), metrics.reconcile_pass("spec"):
        raise error
    assert passes(metrics, "spec", result) == 1
    assert passes(metrics, "spec") == 0
    assert value(metrics, "omnimodel_operator_reconcile_duration_seconds_count", trigger="spec") == 1


def test_a_cancelled_pass_has_no_result(metrics: OperatorMetrics) -> None:
    with pytest.raises(asyncio.CancelledError), metrics.reconcile_pass("resync"):
        raise asyncio.CancelledError
    assert value(metrics, "omnimodel_operator_reconcile_duration_seconds_count", trigger="resync") == 0


def test_series_exist_before_the_first_pass(metrics: OperatorMetrics) -> None:
    """rate() and absent() alerts need the series before anything happens."""
    text = MetricsText.of(metrics)
    for trigger in ("spec", "resync", "child_event"):
        assert text.sample("omnimodel_operator_reconciles_total", trigger=trigger, result="ok") == 0
    assert {
        ready: text.sample("omnimodel_operator_omnimodels", ready=ready) for ready in ("True", "False", "Unknown")
    } == {
        "True": 0,
        "False": 0,
        "Unknown": 0,
    }


def test_ready_counts() -> None:
    def status(ready: str) -> dict[str, Any]:
        return {"conditions": [{"type": "Progressing", "status": "True"}, {"type": "Ready", "status": ready}]}

    statuses = [status("True"), status("True"), status("False"), None, {}, status("Unknown")]
    assert ready_counts(statuses) == {"True": 2, "False": 1, "Unknown": 3}


# ------------------------------------------------------------------------- the handlers' wiring (kopf)


# kopf's decorators type the handlers as kopf callbacks (every kwarg kopf passes); tests pass only what
# they use, as kopf's `**_` allows.
start_metrics: Any = handlers.start_metrics
stop_metrics: Any = handlers.stop_metrics


def kopf_body(obj: dict[str, Any]) -> kopf.Body:
    return kopf.Body(cast("kopf.RawBody", obj))


@pytest.fixture
def wired(kube: FakeKube, metrics: OperatorMetrics, monkeypatch: pytest.MonkeyPatch) -> OperatorMetrics:
    """handlers with the fake API server and a fresh registry."""
    monkeypatch.setattr(handlers, "METRICS", metrics)
    monkeypatch.setitem(handlers._state, "client", kube)
    # Per-object locks bind to the event loop that first waits on them; each test has its own loop.
    monkeypatch.setattr(handlers, "_locks", defaultdict(asyncio.Lock))
    return metrics


async def test_resync_counts_passes_and_refreshes_the_ready_gauge(kube: FakeKube, wired: OperatorMetrics) -> None:
    kube.put(example("text-tiny.yaml"))
    kube.put(example("qwen-omni.yaml"))
    await handlers.resync_once(["ml"], LOGGER)
    assert passes(wired, "resync") == 2
    assert value(wired, "omnimodel_operator_reconcile_duration_seconds_count", trigger="resync") == 2
    assert value(wired, "omnimodel_operator_omnimodels", ready="False") == 2
    assert writes_by_verb(wired)["apply"] > 0

    mark_rolled_out(kube)
    await handlers.resync_once(["ml"], LOGGER)
    assert value(wired, "omnimodel_operator_omnimodels", ready="True") == 2
    assert value(wired, "omnimodel_operator_omnimodels", ready="False") == 0  # replaced, not stale

    before = writes_by_verb(wired)
    await handlers.resync_once(["ml"], LOGGER)  # steady state
    assert passes(wired, "resync") == 6
    assert writes_by_verb(wired) == before


async def test_an_invalid_spec_is_its_own_result(kube: FakeKube, wired: OperatorMetrics) -> None:
    doc = example("text-tiny.yaml")
    doc["spec"]["stages"] = [{"name": "no-such-stage"}]
    kube.put(doc)
    await handlers.resync_once(["ml"], LOGGER)
    assert passes(wired, "resync", "invalid_spec") == 1
    assert passes(wired, "resync") == 0
    assert value(wired, "omnimodel_operator_omnimodels", ready="False") == 1


async def test_spec_and_child_event_passes_are_told_apart(kube: FakeKube, wired: OperatorMetrics) -> None:
    kube.put(example("text-tiny.yaml"))
    await handlers._run(kopf_body(body(kube, "text-tiny")), LOGGER, "spec")
    writes = writes_by_verb(wired)
    mark_rolled_out(kube)
    await handlers._run(kopf_body(body(kube, "text-tiny")), LOGGER, "child_event")
    assert passes(wired, "spec") == 1
    assert passes(wired, "child_event") == 1
    # a child event refreshes status only: the Ready flip, never an apply
    after = writes_by_verb(wired)
    assert after["apply"] == writes["apply"]
    assert after["status"] == writes["status"] + 1


async def test_a_deleted_omnimodel_counts_as_not_found(kube: FakeKube, wired: OperatorMetrics) -> None:
    kube.put(example("text-tiny.yaml"))
    gone = body(kube, "text-tiny")
    kube.remove(gone["apiVersion"], gone["kind"], "ml", "text-tiny")
    assert await handlers._run(kopf_body(gone), LOGGER, "spec") is None
    assert passes(wired, "spec", "not_found") == 1


async def test_a_transient_api_error_is_counted_and_retried(kube: FakeKube, wired: OperatorMetrics) -> None:
    kube.put(example("text-tiny.yaml"))
    kube.fail_next = [ApiError(503, "ServiceUnavailable", "busy")]
    with pytest.raises(kopf.TemporaryError):
        await handlers._run(kopf_body(body(kube, "text-tiny")), LOGGER, "spec")
    assert passes(wired, "spec", "api_error") == 1


# ------------------------------------------------------------------------------------ /metrics over HTTP


class MetricsText:
    """A /metrics text, parsed the way Prometheus reads it."""

    def __init__(self, text: str) -> None:
        self.samples = [s for family in text_string_to_metric_families(text) for s in family.samples]

    @classmethod
    def of(cls, metrics: OperatorMetrics) -> MetricsText:
        server = MetricsServer(metrics.registry, 0, "127.0.0.1")
        try:
            return cls.get(server.port)
        finally:
            server.close()

    @classmethod
    def get(cls, port: int) -> MetricsText:
        response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
        response.raise_for_status()
        return cls(response.text)

    def sample(self, name: str, **labels: str) -> float | None:
        return next((s.value for s in self.samples if s.name == name and s.labels == labels), None)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_server_serves_the_registry_and_frees_its_port(metrics: OperatorMetrics) -> None:
    metrics.reconciles.labels("spec", "ok").inc(3)
    server = MetricsServer(metrics.registry, 0, "127.0.0.1")
    port = server.port
    try:
        text = MetricsText.get(port)
    finally:
        server.close()
    assert text.sample("omnimodel_operator_reconciles_total", trigger="spec", result="ok") == 3
    # Its own registry: nothing from the process-wide default one (python_gc_*, process_*).
    assert not [s for s in text.samples if not s.name.startswith("omnimodel_operator_")]
    assert not _listening(port)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def test_startup_serves_metrics_and_cleanup_stops_them(
    wired: OperatorMetrics, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = _free_port()
    monkeypatch.setattr(handlers, "SETTINGS", OperatorSettings(metrics_port=port))
    start_metrics(logger=LOGGER)
    try:
        # The HTTP round trip runs off the loop: the server thread answers while the test awaits.
        text = await asyncio.to_thread(MetricsText.get, port)
    finally:
        await stop_metrics()
    assert text.sample("omnimodel_operator_reconciles_total", trigger="resync", result="ok") == 0
    assert "metrics" not in handlers._state
    assert not _listening(port)


def test_port_zero_serves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handlers, "SETTINGS", OperatorSettings(metrics_port=0))
    start_metrics(logger=LOGGER)
    assert "metrics" not in handlers._state


def test_a_taken_port_stops_the_operator(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setattr(handlers, "SETTINGS", OperatorSettings(metrics_port=port))
        with pytest.raises(kopf.PermanentError, match=f"Cannot serve metrics on port {port}"):
            start_metrics(logger=LOGGER)
    assert "metrics" not in handlers._state


# ------------------------------------------------------------------------------------------- settings


def test_metrics_port_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert OperatorSettings().metrics_port == 8081
    monkeypatch.setenv("OMNIMODEL_METRICS_PORT", "0")
    assert OperatorSettings().metrics_port == 0
    for bad in ("-1", "65536"):
        monkeypatch.setenv("OMNIMODEL_METRICS_PORT", bad)
        with pytest.raises(pydantic.ValidationError):
            OperatorSettings()
