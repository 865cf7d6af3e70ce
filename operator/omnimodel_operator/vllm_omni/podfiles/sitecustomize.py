"""Replica membership and drain for vLLM-Omni 0.30's head; shipped in the ``<cr>-pipeline`` ConfigMap.

Python imports ``sitecustomize`` at start-up from ``PYTHONPATH`` (the operator points it at the mounted
ConfigMap), so this file runs in every Python process of a vLLM-Omni pod. It does nothing until vLLM-Omni's
own modules load, and then only adds; no request path changes unless a replica is being drained:

- ``GET /omnimodel/replicas`` on the head's API port: per stage, the replicas in the head's pools, each
  with the pod IP it registered from (``--omni-replica-address``; ``null`` for the head's own), whether its
  heartbeat is current (the coordinator's UP), the requests bound to it, and whether it is draining.
  vLLM-Omni 0.30 has no such endpoint; the operator, the replicas' probes and their preStop read this one.
- ``POST /omnimodel/drain?host=<pod IP>``: new requests stop going to that replica while another replica
  of its stage is serviceable (``StagePool._collect_serviceable_replicas`` is the one place 0.30 picks a
  replica for a fresh request); the requests already on it finish. The replica's preStop calls it before
  the kubelet's SIGTERM, which makes the replica send DOWN and the head detach it: 0.30 fails whatever is
  still bound to a replica it detaches ("stage replica disappeared"), so draining first is what keeps a
  scale-down from failing requests.

And one fix of a vLLM-Omni 0.30.0 bug (``_patch_diffusion_client``): detaching a diffusion replica whose
process is already gone froze the head for good.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

_POOLS: weakref.WeakSet[Any] = weakref.WeakSet()
_SERVERS: weakref.WeakSet[Any] = weakref.WeakSet()
_DRAINING: set[str] = set()
_LOCK = threading.Lock()


def _hosts() -> dict[str, str | None]:
    """Input address of each registered slot -> the pod IP it registered from."""
    out: dict[str, str | None] = {}
    for server in list(_SERVERS):
        for alloc in list(getattr(server, "_stage_routes", {}).values()):
            out[str(alloc.input_bind_address)] = getattr(alloc, "replica_host", None)
    return out


def _up(pool: Any) -> set[str]:
    hub = getattr(pool, "_hub", None)
    if hub is None:
        return set()
    listed = hub.get_replicas_for_stage(pool.stage_id).replicas
    return {r.input_addr for r in listed if str(getattr(r.status, "value", r.status)) == "up"}


def replicas() -> dict[str, Any]:
    """What ``GET /omnimodel/replicas`` answers."""
    hosts = _hosts()
    stages: dict[str, list[dict[str, Any]]] = {}
    for pool in list(_POOLS):
        up = _up(pool)
        bound = list(getattr(pool, "_affinity", {}).values())
        rows = []
        for addr, replica_id in sorted(dict(pool._addr_to_replica_id).items(), key=lambda kv: kv[1]):
            if replica_id >= len(pool.clients) or pool.clients[replica_id] is None:
                continue
            host = hosts.get(addr)
            rows.append(
                {
                    "replica": replica_id,
                    "host": host,
                    "up": addr in up if pool._hub is not None else True,
                    "inFlight": bound.count(addr),
                    "draining": host is not None and host in _DRAINING,
                }
            )
        stages[str(pool.stage_id)] = rows
    return {"stages": stages}


def drain(host: str) -> dict[str, Any]:
    with _LOCK:
        _DRAINING.add(host)
    return replicas()


def _wrap_pool(module: ModuleType) -> None:
    cls = module.StagePool
    init: Callable[..., None] = cls.__init__
    collect: Callable[[Any], list[Any]] = cls._collect_serviceable_replicas

    def pool_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        _POOLS.add(self)

    def _collect_serviceable_replicas(self: Any) -> list[Any]:
        candidates = collect(self)
        if not _DRAINING:
            return candidates
        hosts = _hosts()
        kept = [c for c in candidates if hosts.get(c[0].input_addr) not in _DRAINING]
        # The last serviceable replica of a stage keeps serving while it drains: better late than 503.
        return kept or candidates

    cls.__init__ = pool_init
    cls._collect_serviceable_replicas = _collect_serviceable_replicas


def _patch_diffusion_client(module: ModuleType) -> None:
    """vLLM-Omni 0.30.0: ``MembershipController._detach_replica`` calls ``StageDiffusionClient.shutdown()``
    on the orchestrator's event loop, and that first sends a ``shutdown`` message on the client's ZMQ PUSH
    socket with a blocking ``send``. A PUSH socket whose only peer has disconnected is mute: the send waits
    for a peer that never comes, and every request of the head waits behind it. That is the case whenever
    the replica's process is gone before the head detaches it: a replica that got SIGTERM sends DOWN and
    exits at once (on the test bed a 3 -> 1 scale-down froze the head so: py-spy showed its orchestrator
    thread in this send), and one that died is detached 30 s after its last heartbeat. LLM stages' clients
    (vLLM's) close their sockets without sending: only diffusion stages froze. The message is a courtesy to
    a peer that would then stop: sent without waiting, it still reaches a replica that listens, and is
    dropped (``zmq.Again``, which ``shutdown`` already ignores) for one that left."""
    import zmq  # noqa: PLC0415  (vLLM-Omni's own dependency)

    cls = module.StageDiffusionClient
    shutdown: Callable[[Any], None] = cls.shutdown

    def nonblocking_shutdown(self: Any) -> None:
        socket = getattr(self, "_request_socket", None)
        if socket is not None and not socket.closed:
            socket.setsockopt(zmq.SNDTIMEO, 0)
        shutdown(self)

    cls.shutdown = nonblocking_shutdown


def _wrap_master(module: ModuleType) -> None:
    cls = module.OmniMasterServer
    init: Callable[..., None] = cls.__init__

    def server_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        _SERVERS.add(self)

    cls.__init__ = server_init


def _add_routes(module: ModuleType) -> None:
    from fastapi.responses import JSONResponse  # noqa: PLC0415  (vLLM-Omni's own dependency)

    async def get_replicas() -> JSONResponse:
        return JSONResponse(replicas())

    async def post_drain(host: str) -> JSONResponse:
        return JSONResponse(drain(host))

    module.router.add_api_route("/omnimodel/replicas", get_replicas, methods=["GET"])
    module.router.add_api_route("/omnimodel/drain", post_drain, methods=["POST"])


_PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "vllm_omni.engine.stage_pool": _wrap_pool,
    "vllm_omni.engine.stage_engine_startup": _wrap_master,
    "vllm_omni.diffusion.stage_diffusion_client": _patch_diffusion_client,
    "vllm_omni.entrypoints.openai.api_server": _add_routes,
}


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, patch: Callable[[ModuleType], None]) -> None:
        self.inner, self.patch = inner, patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        try:
            self.patch(module)
        except Exception as err:  # an add-on must never stop the server
            print(f"omnimodel sitecustomize: not patching {module.__name__}: {err!r}", file=sys.stderr)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        patch = _PATCHES.get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader, patch)
                return spec
        return None


if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
