"""The operator's Prometheus metrics: passes by trigger and result, API requests by verb, OmniModels by
Ready, the /metrics server and its kopf wiring. Reconciles run against the in-memory API server."""

from __future__ import annotations

import asyncio
import copy
import logging
import socket
from collections import Counter as Tally
from pathlib import Path
from typing import Any

import httpx
import kopf
import pydantic
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from omnimodel_operator import handlers
from omnimodel_operator.kube import ApiError
from omnimodel_operator.metrics import InstrumentedKube, MetricsServer, OperatorMetrics, ready_counts
from omnimodel_operator.reconcile import reconcile
from omnimodel_operator.settings import OperatorSettings
from testkit.fake_kube import FakeKube

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


def value(metrics: OperatorMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def requests_by_verb(metrics: OperatorMetrics) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in metrics.registry.collect():
        if family.name == "omnimodel_operator_api_requests":
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


# -------------------------------------------------------------------------- requests (InstrumentedKube)


async def run(client: Any, kube: FakeKube, name: str) -> Any:
    return await reconcile(client, body(kube, name), kube.snapshot(name), SETTINGS)


async def test_requests_are_counted_by_verb_as_the_api_server_took_them(
    kube: FakeKube, metrics: OperatorMetrics
) -> None:
    kube.put(example("qwen-omni.yaml"))
    outcome = await run(InstrumentedKube(kube, metrics), kube, "qwen-omni")
    by_verb = Tally(verb for verb, _, _ in kube.requests)
    assert requests_by_verb(metrics) == {
        "get": by_verb["get"],  # each child the cache did not show is looked up once (name conflicts)
        "apply": len(outcome.applied),
        "status": 1,
        "event": by_verb["create"],  # the only objects reconcile creates are Events
    }
    assert by_verb["apply"] == len(outcome.applied) == by_verb["get"] == 13
    deployments = sum(1 for verb, kind, _ in kube.requests if (verb, kind) == ("apply", "Deployment"))
    assert value(metrics, "omnimodel_operator_api_requests_total", verb="apply", kind="Deployment") == deployments == 4
    assert value(metrics, "omnimodel_operator_api_requests_total", verb="status", kind="OmniModel") == 1


async def test_a_no_op_pass_adds_no_request_counts(kube: FakeKube, metrics: OperatorMetrics) -> None:
    kube.put(example("qwen-omni.yaml"))
    client = InstrumentedKube(kube, metrics)
    await run(client, kube, "qwen-omni")
    kube.mark_rolled_out()
    await run(client, kube, "qwen-omni")  # Ready: a status write and an event
    before = requests_by_verb(metrics)
    await run(client, kube, "qwen-omni")
    assert requests_by_verb(metrics) == before


async def test_pruning_counts_deletes(kube: FakeKube, metrics: OperatorMetrics) -> None:
    doc = example("custom-graph.yaml")
    extra = {"name": "extra", "kind": "ar", "engine": "transformers", "task": "text-generation", "inputs": ["generate"]}
    doc["spec"]["stages"].append(extra)
    kube.put(doc)
    client = InstrumentedKube(kube, metrics)
    await run(client, kube, "custom-chat")
    assert "delete" not in requests_by_verb(metrics)
    om = kube.find("OmniModel", "custom-chat", "ml")
    assert om is not None
    om["spec"]["stages"].pop()  # its Deployment, Service and NetworkPolicy go
    outcome = await run(client, kube, "custom-chat")
    assert len(outcome.deleted) == 3
    assert requests_by_verb(metrics)["delete"] == 3
    assert value(metrics, "omnimodel_operator_api_requests_total", verb="delete", kind="Deployment") == 1


async def test_a_refused_write_is_not_counted(kube: FakeKube, metrics: OperatorMetrics) -> None:
    kube.put(example("text-tiny.yaml"))
    for kind in ("ConfigMap", "ServiceAccount", "Service", "Deployment", "NetworkPolicy"):
        kube.refuse[("apply", kind)] = ApiError(422, "Invalid", "denied by webhook")
    outcome = await run(InstrumentedKube(kube, metrics), kube, "text-tiny")
    assert len(outcome.errors) == 7  # every child of text-tiny
    assert "apply" not in requests_by_verb(metrics)


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
    with pytest.raises(type(error)), metrics.reconcile_pass("omnimodel"):
        raise error
    assert passes(metrics, "omnimodel", result) == 1
    assert passes(metrics, "omnimodel") == 0
    assert value(metrics, "omnimodel_operator_reconcile_duration_seconds_count", trigger="omnimodel") == 1


def test_a_cancelled_pass_has_no_result(metrics: OperatorMetrics) -> None:
    with pytest.raises(asyncio.CancelledError), metrics.reconcile_pass("resync"):
        raise asyncio.CancelledError
    assert value(metrics, "omnimodel_operator_reconcile_duration_seconds_count", trigger="resync") == 0


def test_series_exist_before_the_first_pass(metrics: OperatorMetrics) -> None:
    """rate() and absent() alerts need the series before anything happens."""
    text = MetricsText.of(metrics)
    for trigger in ("omnimodel", "child", "resync", "retry"):
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
stop: Any = handlers.stop


def memo_with(port: int) -> kopf.Memo:
    memo = kopf.Memo()
    memo.settings = OperatorSettings(metrics_port=port)
    memo.metrics = OperatorMetrics()
    return memo


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
    metrics.reconciles.labels("omnimodel", "ok").inc(3)
    server = MetricsServer(metrics.registry, 0, "127.0.0.1")
    port = server.port
    try:
        text = MetricsText.get(port)
    finally:
        server.close()
    assert text.sample("omnimodel_operator_reconciles_total", trigger="omnimodel", result="ok") == 3
    # Its own registry: nothing from the process-wide default one (python_gc_*, process_*).
    assert not [s for s in text.samples if not s.name.startswith("omnimodel_operator_")]
    assert not _listening(port)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def test_startup_serves_metrics_and_cleanup_stops_them() -> None:
    port = _free_port()
    memo = memo_with(port)
    start_metrics(memo=memo, logger=LOGGER)
    try:
        # The HTTP round trip runs off the loop: the server thread answers while the test awaits.
        text = await asyncio.to_thread(MetricsText.get, port)
    finally:
        await stop(memo=memo)
    assert text.sample("omnimodel_operator_reconciles_total", trigger="resync", result="ok") == 0
    assert not _listening(port)


def test_port_zero_serves_nothing() -> None:
    memo = memo_with(0)
    start_metrics(memo=memo, logger=LOGGER)
    assert "metrics_server" not in memo


def test_a_taken_port_stops_the_operator() -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        memo = memo_with(port)
        with pytest.raises(kopf.PermanentError, match=f"Cannot serve metrics on port {port}"):
            start_metrics(memo=memo, logger=LOGGER)
    assert "metrics_server" not in memo


# ------------------------------------------------------------------------------------------- settings


def test_metrics_port_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert OperatorSettings().metrics_port == 8081
    monkeypatch.setenv("OMNIMODEL_METRICS_PORT", "0")
    assert OperatorSettings().metrics_port == 0
    for bad in ("-1", "65536"):
        monkeypatch.setenv("OMNIMODEL_METRICS_PORT", bad)
        with pytest.raises(pydantic.ValidationError):
            OperatorSettings()
