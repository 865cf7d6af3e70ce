"""kopf wiring, decorators only: watch-fed indexes of OmniModels and of what they own, event handlers
that feed the controller's queue, and start-up/clean-up of the controller and the metrics server.

kopf populates every index from its initial LIST before any event handler runs, so the controller
never reconciles from a half-filled cache. The state lives on kopf's ``memo`` (one per operator).
Index and event handlers are coroutines: kopf runs plain functions on a thread pool, and these only
copy a body or feed the controller's queue, which belongs to the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import kopf

from omnimodel_operator import constants as C
from omnimodel_operator.autoscaler.loop import Autoscaler
from omnimodel_operator.cache import IndexCache, instance_of, owner_of, snapshot
from omnimodel_operator.controller import Controller
from omnimodel_operator.kinds import CHILD_KINDS, POD
from omnimodel_operator.kube import LightKube, load_config
from omnimodel_operator.login import connection_info
from omnimodel_operator.metrics import MetricsServer, OperatorMetrics
from omnimodel_operator.settings import OperatorSettings
from omnimodel_operator.weights_progress import WeightsProgress

OWNED = {C.LABEL_MANAGED_BY: C.MANAGED_BY}


@kopf.on.login()
async def login(settings: kopf.OperatorSettings, **_: Any) -> kopf.ConnectionInfo:
    # Replaces kopf's built-in login, which runs no exec credential plugin: kopf connects with the
    # same config and credentials as the operator's own client, fetched afresh after each 401.
    return await connection_info(load_config(), trust_env=settings.networking.trust_env)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # The handlers below write nothing to OmniModels; should kopf ever keep state, it goes into
    # annotations under our prefix, never into `status`, which is entirely ours.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=C.KOPF_ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=C.KOPF_ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    # Our own events mark transitions; kopf's per-handler "succeeded" events would drown them.
    settings.posting.level = logging.WARNING
    memo.settings = OperatorSettings()
    memo.metrics = OperatorMetrics()


@kopf.on.startup()
def start_metrics(memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    port = memo.settings.metrics_port
    if port == 0:
        return
    try:
        memo.metrics_server = MetricsServer(memo.metrics.registry, port, memo.get("metrics_host", "0.0.0.0"))
    except OSError as err:
        # Permanent: kopf then exits, and a crash-looping pod says more than a silent missing endpoint.
        raise kopf.PermanentError(f"Cannot serve metrics on port {port}: {err}") from err
    logger.info(f"Serving Prometheus metrics on port {port} at /metrics")


@kopf.on.startup()
async def start_controller(memo: kopf.Memo, logger: kopf.Logger, **kwargs: Any) -> None:
    """The indexes arrive as keyword arguments named after their functions below."""
    client = LightKube(load_config())
    memo.client = client
    cache = IndexCache.from_kwargs(kwargs)
    controller = Controller(client, cache, memo.settings, memo.metrics, logger=logger)
    autoscaler = Autoscaler(
        controller.client, cache, memo.settings, on_decision=lambda key: controller.enqueue(key, "autoscaler")
    )
    controller.autoscaler_status = autoscaler.status_of
    progress = WeightsProgress(cache, memo.settings, on_change=lambda key: controller.enqueue(key, "weights"))
    controller.weights_progress = progress.progress_of
    memo.controller, memo.autoscaler, memo.weights_progress = controller, autoscaler, progress
    memo.controller_task = asyncio.create_task(controller.run())
    memo.autoscaler_task = asyncio.create_task(autoscaler.run())
    memo.weights_task = asyncio.create_task(progress.run())


@kopf.on.cleanup()
async def stop(memo: kopf.Memo, **_: Any) -> None:
    names = ("controller_task", "autoscaler_task", "weights_task")
    tasks = [t for t in (memo.get(n) for n in names) if t is not None]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for closable in (memo.get("autoscaler"), memo.get("weights_progress")):
        if closable is not None:
            await closable.aclose()
    client = memo.get("client")
    if client is not None:
        await client.aclose()
    server = memo.get("metrics_server")
    if server is not None:
        # shutdown() waits for the serving thread's next poll: off the event loop.
        await asyncio.to_thread(server.close)


# ------------------------------------------------------------------------------------ indexes


@kopf.index(C.GROUP, C.VERSION, C.PLURAL)
async def omnimodels(namespace: str | None, name: str, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    return {(namespace, name): snapshot(body)}


@kopf.index(C.GROUP, C.VERSION, C.PLURAL)
async def omnimodel_instances(namespace: str | None, name: str, **_: Any) -> dict[Any, Any]:
    return {(namespace, instance_of(name)): name}


async def child_index(namespace: str | None, body: kopf.Body, **_: Any) -> dict[Any, Any] | None:
    instance = (body["metadata"].get("labels") or {}).get(C.LABEL_INSTANCE)
    return {(namespace, instance): snapshot(body)} if instance else None


# One index per kind in the table (and one of pods), named after the kind's plural: the controller's cache
# reads them by those names (IndexCache.from_kwargs).
for _kind in (*CHILD_KINDS, POD):
    kopf.index(_kind.api_version, _kind.plural, labels=OWNED, id=_kind.index)(child_index)


# ------------------------------------------------------------------------------------- events


@kopf.on.event(C.GROUP, C.VERSION, C.PLURAL)
async def omnimodel_changed(memo: kopf.Memo, type: str, namespace: str | None, name: str, **_: Any) -> None:
    memo.controller.on_omnimodel(namespace or "", name, type)


async def child_changed(memo: kopf.Memo, namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any) -> None:
    memo.controller.on_child(namespace or "", owner_of(body), labels.get(C.LABEL_INSTANCE))


for _kind in (*CHILD_KINDS, POD):
    kopf.on.event(_kind.api_version, _kind.plural, labels=OWNED, id=f"{_kind.plural}-changed")(child_changed)
