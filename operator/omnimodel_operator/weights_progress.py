"""The running fetch pods' progress, scraped for ``status.weights`` while a download is under way.

A fetch makes no Kubernetes event between its pod starting and ending, so nothing would reconcile the
OmniModel while tens of gigabytes arrive. Every ``OMNIMODEL_WEIGHTS_PROGRESS_INTERVAL`` seconds this
reads ``GET /progress`` of each running fetch pod (found in the watch-fed cache, so no API request) and
queues the OmniModel when the numbers moved; reconcile puts the last reading in status.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import httpx

from omnimodel_operator import constants as C
from omnimodel_operator.builders.weights import COMPONENT_FETCH, PROGRESS_PORT
from omnimodel_operator.kube import Manifest
from omnimodel_operator.observed import Observed
from omnimodel_operator.settings import OperatorSettings

Key = tuple[str, str]
log = logging.getLogger("omnimodel_operator")
# What a reading keeps: enough for status, not the fetch's timing (which would change every scrape).
FIELDS = ("state", "sha", "files_done", "files_total", "bytes_done", "bytes_total", "reason")


class Source(Protocol):
    def observed(self, namespace: str, name: str) -> Observed: ...

    def omnimodel_keys(self) -> Any: ...


def running_fetch_pod(pods: list[Manifest] | tuple[Manifest, ...] | Any) -> Manifest | None:
    for pod in pods:
        labels = pod["metadata"].get("labels") or {}
        status = pod.get("status") or {}
        running = status.get("phase") == "Running" and status.get("podIP")
        if labels.get(C.LABEL_COMPONENT) == COMPONENT_FETCH and running:
            return dict(pod)
    return None


class WeightsProgress:
    def __init__(
        self,
        source: Source,
        settings: OperatorSettings,
        *,
        on_change: Callable[[Key], None] = lambda key: None,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        self.source = source
        self.settings = settings
        self.on_change = on_change
        self.http = http or httpx.AsyncClient(timeout=settings.autoscale_scrape_timeout)
        self._readings: dict[Key, dict[str, Any]] = {}

    def progress_of(self, key: Key) -> Mapping[str, Any] | None:
        return self._readings.get(key)

    async def run(self) -> None:
        while True:
            # Pacing, not synchronisation: one round of scrapes per interval.
            await asyncio.sleep(self.settings.weights_progress_interval)
            await self.once()

    async def once(self) -> None:
        await asyncio.gather(*(self._one(key) for key in list(self.source.omnimodel_keys())))

    async def _one(self, key: Key) -> None:
        pod = running_fetch_pod(self.source.observed(*key).pods)
        if pod is None:
            self._readings.pop(key, None)
            return
        url = f"http://{pod['status']['podIP']}:{PROGRESS_PORT}/progress"
        try:
            response = await self.http.get(url)
            response.raise_for_status()
            data = response.json()
        except (httpx.HTTPError, ValueError) as err:
            # Status keeps the last reading; the pod's own end (its termination message) is what counts.
            log.debug(f"fetch progress of {key[0]}/{key[1]} from {url}: {err}")
            return
        reading = {k: data.get(k) for k in FIELDS}
        if reading != self._readings.get(key):
            self._readings[key] = reading
            self.on_change(key)

    async def aclose(self) -> None:
        await self.http.aclose()
