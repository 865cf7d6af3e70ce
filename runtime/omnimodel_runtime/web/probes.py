"""The probes the stage server and the gateway both answer: ``/livez`` and ``/metrics``."""

from __future__ import annotations

from typing import Final

from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry

from omnimodel_runtime.metrics import PROMETHEUS_CONTENT_TYPE, render
from omnimodel_runtime.web.startup import Startup

# Polled every few seconds by kubelets, gateways and Prometheus: their access lines are debug-level.
PROBE_PATHS: Final = frozenset({"/livez", "/health", "/metrics"})


def livez(startup: Startup) -> JSONResponse:
    """200 while the process is usable; 503 once its start-up failed, so the kubelet restarts it (a slow
    start is not a failure: ``/health`` says when it is ready)."""
    if startup.failed.is_set():
        return JSONResponse(startup.describe(), status_code=503)
    return JSONResponse({"status": "alive"})


def metrics(registry: CollectorRegistry) -> Response:
    """The registry in Prometheus text format."""
    return Response(render(registry), media_type=PROMETHEUS_CONTENT_TYPE)
