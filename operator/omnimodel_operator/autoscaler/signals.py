"""The load signals the autoscaler decides on, read from the runtimes' own /metrics on the pods.

This project's runtime: every gateway pod reports, per stage, the requests it has in flight there
(``omnimodel_gateway_stage_in_flight``), the requests it holds because the stage has no ready
replica (``omnimodel_gateway_stage_waiting``: a stage at zero), and the stage's request times
(``omnimodel_gateway_stage_request_seconds``, for pendingSeconds); stage pods report their queue
(``omnimodel_queue_depth``). vLLM-Omni: the head reports ``vllm_omni:stage_waiting_requests`` per
stage id. Pods are found in the watch-fed cache (their IPs), so reading signals costs no API request.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import httpx
from prometheus_client.parser import text_string_to_metric_families

from omnimodel_operator import constants as C

Manifest = dict[str, Any]

GATEWAY_IN_FLIGHT: Final = "omnimodel_gateway_stage_in_flight"
GATEWAY_WAITING: Final = "omnimodel_gateway_stage_waiting"
GATEWAY_SECONDS: Final = "omnimodel_gateway_stage_request_seconds"
GATEWAY_BUSY: Final = "omnimodel_gateway_stage_busy_seconds_total"
STAGE_QUEUE: Final = "omnimodel_queue_depth"
VLLM_OMNI_WAITING: Final = "vllm_omni:stage_waiting_requests"


@dataclass
class Readings:
    """Per stage: in flight, waiting for a replica, mean request seconds, queued at the stage."""

    in_flight: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    # In flight integrated over time, summed over the gateways that answered (its rate is the mean
    # concurrency since the last reading).
    busy_seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    waiting: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    seconds_sum: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    seconds_count: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    queue: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    errors: list[str] = field(default_factory=list)

    def mean_seconds(self, stage: str) -> float | None:
        count = self.seconds_count.get(stage, 0.0)
        return self.seconds_sum.get(stage, 0.0) / count if count else None


def _running_ip(pod: Mapping[str, Any]) -> str | None:
    status = pod.get("status") or {}
    if pod["metadata"].get("deletionTimestamp") or status.get("phase") != "Running":
        return None
    ip = status.get("podIP")
    return str(ip) if ip else None


def _label(pod: Mapping[str, Any], key: str) -> str | None:
    return (pod["metadata"].get("labels") or {}).get(key)


def parse(text: str, readings: Readings, *, stage_of_pod: str | None = None, stage_ids: Mapping[str, str]) -> None:
    """Add one /metrics page to ``readings``. ``stage_ids`` maps vLLM-Omni stage ids to stage names."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            stage = sample.labels.get("stage")
            if sample.name == GATEWAY_IN_FLIGHT and stage:
                readings.in_flight[stage] += sample.value
            elif sample.name == GATEWAY_BUSY and stage:
                readings.busy_seconds[stage] += sample.value
            elif sample.name == GATEWAY_WAITING and stage:
                readings.waiting[stage] += sample.value
            elif sample.name == f"{GATEWAY_SECONDS}_sum" and stage:
                readings.seconds_sum[stage] += sample.value
            elif sample.name == f"{GATEWAY_SECONDS}_count" and stage:
                readings.seconds_count[stage] += sample.value
            elif sample.name == STAGE_QUEUE and stage_of_pod:
                readings.queue[stage_of_pod] += sample.value
            elif sample.name == VLLM_OMNI_WAITING and stage is not None and stage in stage_ids:
                readings.queue[stage_ids[stage]] += sample.value


async def read(
    client: httpx.AsyncClient,
    pods: Sequence[Manifest],
    *,
    gateway_port: int,
    stage_port: int | None,
    stage_ids: Mapping[str, str] | None = None,
    scrape_stages: Iterable[str] = (),
) -> Readings:
    """Scrape the gateway (or vLLM-Omni head) pods, and the stage pods of ``scrape_stages``."""
    readings = Readings()
    wanted = set(scrape_stages)
    targets: list[tuple[str, str | None]] = []
    for pod in pods:
        ip = _running_ip(pod)
        component = _label(pod, C.LABEL_COMPONENT)
        if ip is None:
            continue
        if component in (C.COMPONENT_GATEWAY, "head"):
            targets.append((f"http://{ip}:{gateway_port}/metrics", None))
        elif component == C.COMPONENT_STAGE and stage_port and (stage := _label(pod, C.LABEL_STAGE)) in wanted:
            targets.append((f"http://{ip}:{stage_port}/metrics", stage))

    async def one(url: str, stage: str | None) -> None:
        try:
            response = await client.get(url)
            response.raise_for_status()
        except httpx.HTTPError as err:
            readings.errors.append(f"{url}: {err!r}")
            return
        parse(response.text, readings, stage_of_pod=stage, stage_ids=stage_ids or {})

    await asyncio.gather(*(one(url, stage) for url, stage in targets))
    return readings
