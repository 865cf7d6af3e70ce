"""kopf wiring. Decorators only: every handler parses nothing itself and calls :func:`reconcile`."""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from typing import Any, cast

import kopf

from omnimodel_operator import constants as C
from omnimodel_operator.kube import ApiError, HttpKube, KubeClient, load_connection
from omnimodel_operator.metrics import CountingKube, MetricsServer, OperatorMetrics, Trigger, ready_counts
from omnimodel_operator.reconcile import Outcome, reconcile
from omnimodel_operator.settings import OperatorSettings

SETTINGS = OperatorSettings()
METRICS = OperatorMetrics()
_state: dict[str, Any] = {}
# One reconcile at a time per object: the timer, child events and spec handlers may fire together.
_locks: defaultdict[tuple[str, str], asyncio.Lock] = defaultdict(asyncio.Lock)
# Objects with a status refresh already queued behind their lock (see child_changed).
_refresh_waiting: set[tuple[str, str]] = set()


def watch_namespaces(namespaces: list[str]) -> None:
    """The namespaces the resync pass lists; empty means cluster-wide."""
    _state["namespaces"] = list(namespaces)


def _client() -> KubeClient:
    client: KubeClient | None = _state.get("client")
    if client is None:
        client = HttpKube(load_connection())
        _state["client"] = client
    return client


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Keep kopf's bookkeeping out of `status`, which is entirely ours.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=C.KOPF_ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=C.KOPF_ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    # Our own events mark transitions; kopf's per-handler "succeeded" events would drown them.
    settings.posting.level = logging.WARNING
    settings.execution.max_workers = 4


@kopf.on.startup()
async def start_resync(logger: kopf.Logger, **_: Any) -> None:
    """One periodic level-based pass over every watched OmniModel (like controller-runtime's
    SyncPeriod). Not a kopf timer: kopf puts a finalizer on objects with timers, and a finalizer would
    make OmniModels (and their namespaces) undeletable whenever the operator is not running."""
    _state["resync"] = asyncio.create_task(_resync_forever(logger))


@kopf.on.startup()
def start_metrics(logger: kopf.Logger, **_: Any) -> None:
    port = SETTINGS.metrics_port
    if port == 0:
        return
    try:
        _state["metrics"] = MetricsServer(METRICS.registry, port)
    except OSError as err:
        # Permanent: kopf then exits, and a crash-looping pod says more than a silent missing endpoint.
        raise kopf.PermanentError(f"Cannot serve metrics on port {port}: {err}") from err
    logger.info(f"Serving Prometheus metrics on port {port} at /metrics")


@kopf.on.cleanup()
async def stop_metrics(**_: Any) -> None:
    server: MetricsServer | None = _state.pop("metrics", None)
    if server is not None:
        # shutdown() waits for the serving thread's next poll: off the event loop.
        await asyncio.to_thread(server.close)


@kopf.on.cleanup()
async def close_client(**_: Any) -> None:
    task = _state.pop("resync", None)
    if task is not None:
        task.cancel()
    client = _state.pop("client", None)
    if isinstance(client, HttpKube):
        await client.aclose()


async def _resync_forever(logger: logging.Logger | logging.LoggerAdapter[Any]) -> None:
    namespaces: list[str] = _state.get("namespaces") or [""]  # "" lists across all namespaces
    while True:
        # Pacing, not synchronisation: the next pass is due one interval after this one.
        await asyncio.sleep(SETTINGS.status_interval)
        try:
            await resync_once(namespaces, logger)
        except ApiError as err:
            logger.warning(f"Resync pass failed, will try again: {err}")


async def resync_once(namespaces: list[str], logger: logging.Logger | logging.LoggerAdapter[Any]) -> None:
    """Reconcile every OmniModel once; one object's failure does not stop the pass. Refreshes the
    OmniModels-by-Ready gauge from what the pass saw."""
    client = _client()
    limit = asyncio.Semaphore(8)
    statuses: list[dict[str, Any] | None] = []

    async def one(obj: dict[str, Any]) -> None:
        if obj["metadata"].get("deletionTimestamp"):
            return
        outcome: Outcome | None = None
        async with limit:
            try:
                outcome = await _run(kopf.Body(cast("kopf.RawBody", obj)), logger, "resync")
            except kopf.TemporaryError as err:
                logger.warning(f"Resync of {obj['metadata']['namespace']}/{obj['metadata']['name']}: {err}")
        # The status this pass wrote, else the one it listed (the pass failed for this object).
        statuses.append(outcome.status if outcome is not None else obj.get("status"))

    for namespace in namespaces:
        items = await client.list(C.API_VERSION, C.KIND, namespace, {})
        await asyncio.gather(*(one(obj) for obj in items))
    METRICS.set_omnimodels(ready_counts(statuses))


async def _run(
    body: kopf.Body, logger: logging.Logger | logging.LoggerAdapter[Any], trigger: Trigger
) -> Outcome | None:
    """One counted, timed reconcile; None when the OmniModel went away meanwhile. A child event
    needs only status (see :func:`reconcile`)."""
    key = (body["metadata"]["namespace"], body["metadata"]["name"])
    client = CountingKube(_client(), METRICS)
    async with _locks[key]:
        try:
            with METRICS.reconcile_pass(trigger) as reconcile_pass:
                outcome = await reconcile(client, body, SETTINGS, status_only=trigger == "child_event")
                reconcile_pass.finished(outcome)
        except ApiError as err:
            if err.status == 404:  # deleted while we worked; garbage collection does the rest
                logger.debug(f"Stopped reconciling: {err}")
                return None
            if err.transient:
                raise kopf.TemporaryError(f"API error, will retry: {err}", delay=5) from err
            raise
    for ref in outcome.applied:
        logger.info(f"Applied {ref}")
    for ref in outcome.deleted:
        logger.info(f"Deleted {ref}")
    if outcome.invalid is not None:
        logger.warning(f"Invalid spec, nothing applied: {outcome.invalid}")
    return outcome


@kopf.on.resume(C.GROUP, C.VERSION, C.PLURAL)
@kopf.on.create(C.GROUP, C.VERSION, C.PLURAL)
@kopf.on.update(C.GROUP, C.VERSION, C.PLURAL, field="spec")
async def reconcile_spec(body: kopf.Body, logger: kopf.Logger, **_: Any) -> None:
    await _run(body, logger, "spec")


@kopf.on.event("apps", "v1", "deployments", labels={C.LABEL_MANAGED_BY: C.MANAGED_BY})
async def child_changed(body: kopf.Body, logger: kopf.Logger, **_: Any) -> None:
    """A stage's Deployment changed (pods became ready, a rollout finished): refresh the owner now
    rather than on the next timer tick."""
    owner = next(
        (r for r in body["metadata"].get("ownerReferences") or [] if r.get("kind") == C.KIND and r.get("controller")),
        None,
    )
    if owner is None:
        return
    key = (body["metadata"]["namespace"], owner["name"])
    # Coalesce: a rollout sends each Deployment's status through several events, and an OmniModel
    # has several Deployments. One refresh that starts after an event sees that event's change, so
    # while one is already waiting for the object's lock, further events need not queue another.
    if key in _refresh_waiting:
        return
    _refresh_waiting.add(key)
    try:
        async with _locks[key]:
            _refresh_waiting.discard(key)
            try:
                parent = await _client().get(C.API_VERSION, C.KIND, key[0], key[1])
            except ApiError as err:
                logger.debug(f"Skipped status refresh of {owner['name']}: {err}")
                return
    finally:
        _refresh_waiting.discard(key)
    if parent is None or parent["metadata"].get("uid") != owner.get("uid"):
        return
    await _run(kopf.Body(cast("kopf.RawBody", parent)), logger, "child_event")
