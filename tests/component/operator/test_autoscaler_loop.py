"""The autoscaler loop against the in-memory API server: signals read from the gateway pods' /metrics
(served here by an httpx mock transport standing in for the pods), replicas set through the scale
subresource, status and Events, and stages without autoscaling never touched."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from omnimodel_operator.autoscaler.loop import Autoscaler
from omnimodel_operator.reconcile import reconcile
from omnimodel_operator.settings import OperatorSettings
from testkit.fake_kube import FakeCache, FakeKube

REPO = Path(__file__).parents[3]
SETTINGS = OperatorSettings()


def omni(talker: dict[str, Any]) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((REPO / "examples" / "qwen-omni.yaml").read_text())
    doc["metadata"]["namespace"] = "ml"
    doc["spec"]["stages"][1]["autoscaling"] = talker
    return doc


def gateway_pod(ip: str, n: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"qwen-omni-gateway-{n}",
            "namespace": "ml",
            "labels": {
                "app.kubernetes.io/instance": "qwen-omni",
                "app.kubernetes.io/managed-by": "omnimodel-operator",
                "app.kubernetes.io/component": "gateway",
            },
        },
        "status": {"phase": "Running", "podIP": ip},
    }


class Pods:
    """/metrics of each gateway pod by IP; None makes that pod fail to answer."""

    def __init__(self) -> None:
        self.metrics: dict[str, str | None] = {}

    def handler(self, request: httpx.Request) -> httpx.Response:
        text = self.metrics.get(request.url.host)
        if text is None:
            return httpx.Response(503)
        return httpx.Response(200, text=text)


def metrics(in_flight: dict[str, float], waiting: dict[str, float] | None = None) -> str:
    lines = [f'omnimodel_gateway_stage_in_flight{{stage="{s}"}} {v}' for s, v in in_flight.items()]
    lines += [f'omnimodel_gateway_stage_waiting{{stage="{s}"}} {v}' for s, v in (waiting or {}).items()]
    return "\n".join(["# TYPE omnimodel_gateway_stage_in_flight gauge", *lines]) + "\n"


@pytest.fixture
async def setup() -> Any:
    kube = FakeKube()
    pods = Pods()
    decided: list[tuple[str, str]] = []
    clock = [1000.0]
    http = httpx.AsyncClient(transport=httpx.MockTransport(pods.handler))
    scaler = Autoscaler(kube, FakeCache(kube), SETTINGS, on_decision=decided.append, clock=lambda: clock[0], http=http)
    yield kube, pods, scaler, decided, clock
    await http.aclose()


async def converge(kube: FakeKube) -> None:
    body = copy.deepcopy(kube.find("OmniModel", "qwen-omni", "ml"))
    assert body is not None
    await reconcile(kube, body, kube.snapshot("qwen-omni"), SETTINGS)


async def test_load_on_the_talker_scales_it_and_only_it(setup: Any) -> None:
    kube, pods, scaler, decided, _ = setup
    kube.put(omni({"minReplicas": 1, "maxReplicas": 4}))
    await converge(kube)
    kube.put(gateway_pod("10.244.0.7", 0))
    kube.put(gateway_pod("10.244.0.8", 1))
    pods.metrics = {"10.244.0.7": metrics({"talker": 6, "thinker": 20}), "10.244.0.8": metrics({"talker": 5})}
    decisions = await scaler.scale(("ml", "qwen-omni"))
    assert [(d.stage, d.current, d.desired) for d in decisions] == [("talker", 1, 3)]  # 11 in flight / 4 each
    talker = kube.find("Deployment", "qwen-omni-talker", "ml")
    assert talker is not None and talker["spec"]["replicas"] == 3
    scaled = [r for r in kube.requests if r[0] == "scale"]
    assert scaled == [("scale", "Deployment", "qwen-omni-talker")]  # the thinker has no autoscaling: untouched
    assert decided == [("ml", "qwen-omni")]
    status = scaler.status_of(("ml", "qwen-omni"))["talker"]
    assert (status.kind, status.desired_replicas, status.metric, status.signal) == (
        "OmniModelAutoscaler",
        3,
        "inFlight",
        11,
    )
    assert "needs 3" in (status.reason or "")
    event = next(e for e in kube.of_kind("Event") if e["reason"] == "Scaled")
    assert "talker: 1 -> 3 replicas" in event["message"]
    # The status the reconcile writes carries the decision.
    body = copy.deepcopy(kube.find("OmniModel", "qwen-omni", "ml"))
    await reconcile(kube, body, kube.snapshot("qwen-omni"), SETTINGS, autoscalers=scaler.status_of(("ml", "qwen-omni")))
    stages = {s["name"]: s for s in kube.find("OmniModel", "qwen-omni", "ml")["status"]["stages"]}
    assert stages["talker"]["autoscaler"]["desiredReplicas"] == 3


async def test_a_gateway_that_does_not_answer_blocks_scale_down_not_scale_up(setup: Any) -> None:
    kube, pods, scaler, _, clock = setup
    kube.put(omni({"minReplicas": 1, "maxReplicas": 4, "scaleDownWindowSeconds": 0}))
    await converge(kube)
    kube.put(gateway_pod("10.244.0.7", 0))
    kube.put(gateway_pod("10.244.0.8", 1))
    pods.metrics = {"10.244.0.7": metrics({"talker": 16}), "10.244.0.8": metrics({})}
    await scaler.scale(("ml", "qwen-omni"))
    talker = kube.find("Deployment", "qwen-omni-talker", "ml")
    assert talker is not None and talker["spec"]["replicas"] == 4
    pods.metrics = {"10.244.0.7": metrics({"talker": 0}), "10.244.0.8": None}  # one pod silent, no load seen
    clock[0] += 60
    (decision,) = await scaler.scale(("ml", "qwen-omni"))
    assert (decision.current, decision.desired) == (4, 4)
    assert "did not report" in decision.reason


def busy_metrics(busy: dict[str, float], in_flight: dict[str, float]) -> str:
    lines = [f'omnimodel_gateway_stage_busy_seconds_total{{stage="{s}"}} {v}' for s, v in busy.items()]
    return metrics(in_flight) + "\n".join(["# TYPE omnimodel_gateway_stage_busy_seconds counter", *lines]) + "\n"


async def test_the_mean_concurrency_between_decisions_drives_in_flight_not_the_instant(setup: Any) -> None:
    """Short requests: the gauge read at the instant of a scrape may show 0 of 6 busy clients. The rate of
    the gateways' busy seconds is the mean in flight since the last decision (Little's law)."""
    kube, pods, scaler, _, clock = setup
    kube.put(omni({"minReplicas": 1, "maxReplicas": 4, "target": 2}))
    await converge(kube)
    kube.put(gateway_pod("10.244.0.7", 0))
    kube.put(gateway_pod("10.244.0.8", 1))
    pods.metrics = {
        "10.244.0.7": busy_metrics({"talker": 100.0}, {"talker": 0}),
        "10.244.0.8": busy_metrics({"talker": 50.0}, {"talker": 0}),
    }
    (first,) = await scaler.scale(("ml", "qwen-omni"))
    assert (first.current, first.desired) == (1, 1)  # the first reading has nothing to compare with: the gauge
    clock[0] += 10
    pods.metrics = {  # 40 + 20 busy seconds in 10 s: six in flight on average, none at this instant
        "10.244.0.7": busy_metrics({"talker": 140.0}, {"talker": 0}),
        "10.244.0.8": busy_metrics({"talker": 70.0}, {"talker": 0}),
    }
    (second,) = await scaler.scale(("ml", "qwen-omni"))
    assert (second.current, second.desired, second.signal) == (1, 3, 6.0)
    clock[0] += 10
    pods.metrics = {  # a gateway restarted: its counter went back; the instant's gauge decides this once
        "10.244.0.7": busy_metrics({"talker": 5.0}, {"talker": 4}),
        "10.244.0.8": busy_metrics({"talker": 75.0}, {"talker": 0}),
    }
    (third,) = await scaler.scale(("ml", "qwen-omni"))
    assert third.signal == 4.0
