"""The controller: its work queue, event coalescing, failure isolation and backoff, and status writes
that neither repeat nor post an Event twice when the cache lags. Against the in-memory API server."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from omnimodel_operator import conditions as cond
from omnimodel_operator.controller import Controller, WorkQueue
from omnimodel_operator.kube import ApiError
from omnimodel_operator.metrics import OperatorMetrics
from omnimodel_operator.settings import OperatorSettings
from testkit.fake_kube import FakeCache, FakeKube

REPO = Path(__file__).parents[3]
LOG = logging.getLogger("test-controller")


def example(name: str, namespace: str = "ml") -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((REPO / "examples" / name).read_text())
    doc["metadata"]["namespace"] = namespace
    return doc


def value(metrics: OperatorMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


# ------------------------------------------------------------------------------------- the queue


async def test_a_key_added_while_processing_runs_once_more_never_concurrently() -> None:
    queue: WorkQueue[str] = WorkQueue()
    queue.add("a")
    queue.add("a")  # already queued: one entry
    assert len(queue) == 1
    key = await queue.get()
    queue.add("a")
    queue.add("a")
    assert len(queue) == 0  # being processed: marked dirty, not queued beside itself
    queue.done(key)
    assert len(queue) == 1
    assert await queue.get() == "a"
    queue.done("a")
    assert len(queue) == 0


async def test_delayed_adds_keep_the_earliest_due_time() -> None:
    queue: WorkQueue[str] = WorkQueue()
    queue.add("a", 0.05)
    queue.add("a", 5.0)  # a later due time does not postpone the earlier one
    assert await asyncio.wait_for(queue.get(), 2) == "a"
    queue.done("a")
    queue.close()


def test_retry_delay_doubles_up_to_the_cap_and_resets_after_success() -> None:
    async def main() -> list[float]:
        queue: WorkQueue[str] = WorkQueue(base_delay=1, max_delay=5)
        delays = [queue.add_rate_limited("a") for _ in range(5)]
        queue.forget("a")
        delays.append(queue.add_rate_limited("a"))
        queue.close()
        return delays

    assert asyncio.run(main()) == [1, 2, 4, 5, 5, 1]


# ------------------------------------------------------------------------------------- the controller


class Harness:
    def __init__(self) -> None:
        self.kube = FakeKube()
        self.cache = FakeCache(self.kube)
        self.metrics = OperatorMetrics()
        settings = OperatorSettings(event_coalesce_seconds=0.05, retry_base_delay=0.05, retry_max_delay=0.2)
        self.controller = Controller(self.kube, self.cache, settings, self.metrics, logger=LOG)

    def put(self, doc: dict[str, Any]) -> None:
        self.kube.put(doc)
        self.controller.on_omnimodel(doc["metadata"]["namespace"], doc["metadata"]["name"], "ADDED")

    def passes(self, trigger: str, result: str = "ok") -> float:
        return value(self.metrics, "omnimodel_operator_reconciles_total", trigger=trigger, result=result)

    async def settle(self) -> None:
        await asyncio.wait_for(self.controller.wait_idle(), 10)


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    h = Harness()
    task = asyncio.create_task(h.controller.run())
    try:
        yield h
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_an_event_burst_on_children_costs_one_pass(harness: Harness) -> None:
    harness.put(example("qwen-omni.yaml"))
    await harness.settle()
    harness.kube.mark_rolled_out()
    for _ in range(20):  # a rollout: many Deployment and pod events
        harness.controller.on_child("ml", "qwen-omni", "qwen-omni")
    await asyncio.sleep(0)  # the events are in before the coalescing delay runs out
    await asyncio.wait_for(_until(lambda: harness.passes("child") >= 1), 5)
    await harness.settle()
    assert harness.passes("child") == 1
    ready = cond.find(harness.kube.find("OmniModel", "qwen-omni", "ml")["status"]["conditions"], cond.READY)  # type: ignore[index]
    assert ready is not None and ready["status"] == "True"


async def test_pod_events_find_their_omnimodel_by_instance_label(harness: Harness) -> None:
    harness.put(example("text-tiny.yaml"))
    await harness.settle()
    harness.controller.on_child("ml", None, "text-tiny")  # pods are owned by ReplicaSets
    await asyncio.wait_for(_until(lambda: harness.passes("child") == 1), 5)


async def test_a_failing_omnimodel_backs_off_and_never_holds_up_the_others(harness: Harness) -> None:
    bad = example("text-tiny.yaml")
    bad["metadata"]["name"] = "bad"
    bad["spec"]["stages"] = [{"name": "llm", "disruption": {"minAvailable": "150%"}}]
    harness.kube.refuse[("apply", "PodDisruptionBudget")] = ApiError(422, "Invalid", "minAvailable: must be <= 100%")
    harness.put(bad)
    for i in range(5):
        good = example("text-tiny.yaml")
        good["metadata"]["name"] = f"good-{i}"
        harness.put(good)
    await asyncio.wait_for(_until(lambda: harness.passes("retry", "apply_error") >= 2), 5)
    for i in range(5):
        assert harness.kube.find("Deployment", f"good-{i}-llm", "ml") is not None
    assert harness.passes("omnimodel") == 5
    del harness.kube.refuse[("apply", "PodDisruptionBudget")]
    await asyncio.wait_for(_until(lambda: harness.passes("retry") >= 1), 5)
    assert harness.kube.find("PodDisruptionBudget", "bad-llm", "ml") is not None


async def test_a_stale_cache_writes_status_and_the_event_once(harness: Harness) -> None:
    """The watch event of our own status write may arrive after the next pass starts."""
    harness.put(example("text-tiny.yaml"))
    await harness.settle()
    harness.kube.mark_rolled_out()
    stale = harness.kube.find("OmniModel", "text-tiny", "ml")
    assert stale is not None
    harness.cache.stale[("ml", "text-tiny")] = {**stale, "status": dict(stale["status"])}
    for _ in range(3):
        harness.controller.enqueue(("ml", "text-tiny"), "child")
        await harness.settle()
    writes = [w for w in harness.kube.writes if w[1] in ("OmniModel", "Event")]
    ready_events = [o for o in harness.kube.of_kind("Event") if o["reason"] == "Ready"]
    assert len(ready_events) == 1
    assert [w[0] for w in writes].count("status") == 2  # Ready=False at creation, Ready=True once


async def test_resync_of_an_unchanged_fleet_sends_no_request(harness: Harness) -> None:
    for name in ("text-tiny.yaml", "qwen-omni.yaml", "tts.yaml"):
        harness.put(example(name))
    await harness.settle()
    harness.kube.mark_rolled_out()
    assert harness.controller.resync() == 3
    await harness.settle()
    before = len(harness.kube.requests)
    harness.controller.resync()
    await harness.settle()
    assert harness.kube.requests[before:] == []
    assert value(harness.metrics, "omnimodel_operator_omnimodels", ready="True") == 3


async def test_a_deleted_omnimodel_is_dropped(harness: Harness) -> None:
    harness.put(example("text-tiny.yaml"))
    await harness.settle()
    harness.kube.remove("omnimodel.io/v1alpha1", "OmniModel", "ml", "text-tiny")
    harness.controller.on_omnimodel("ml", "text-tiny", "DELETED")
    harness.controller.enqueue(("ml", "text-tiny"), "child")
    await harness.settle()
    assert value(harness.metrics, "omnimodel_operator_omnimodels", ready="False") == 0


async def _until(check: Any) -> None:
    """Poll a metric (callers bound it with wait_for): counters have no event to wait on."""
    while not check():  # noqa: ASYNC110
        await asyncio.sleep(0.01)
