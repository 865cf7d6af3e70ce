"""The head's shim (vllm_omni/podfiles/sitecustomize.py) unfreezes vLLM-Omni 0.30.0's detach of a departed
diffusion replica: ``StageDiffusionClient.shutdown`` sent on a ZMQ PUSH socket whose peer was gone, and a
blocking send there never returns (e2e: a 3 -> 1 scale-down froze the head's orchestrator in it).

``Shipped`` is 0.30.0's ``shutdown`` as it ships (``vllm_omni/diffusion/stage_diffusion_client.py``), over
real ZMQ sockets; the e2e test runs the real one."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

import omnimodel_operator.vllm_omni.podfiles as podfiles


class Shipped:
    """The head's client of one remote diffusion replica: it binds, the replica connects."""

    def __init__(self) -> None:
        self._zmq_ctx = zmq.Context()
        self._request_socket = self._zmq_ctx.socket(zmq.PUSH)
        self._request_socket.bind("tcp://127.0.0.1:*")
        self.request_address = self._request_socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._response_socket = self._zmq_ctx.socket(zmq.PULL)
        self._response_socket.bind("tcp://127.0.0.1:*")

    def shutdown(self) -> None:
        self._shutting_down = True
        with contextlib.suppress(Exception):  # 0.30.0: try/send/except Exception: pass
            self._request_socket.send(b"shutdown")
        self._request_socket.close(linger=0)
        self._response_socket.close(linger=0)
        self._zmq_ctx.term()


@pytest.fixture
def shim() -> Iterator[Any]:
    path = Path(podfiles.__file__).with_name("sitecustomize.py")
    spec = importlib.util.spec_from_file_location("omnimodel_shim_under_test", path)
    assert spec is not None and spec.loader is not None
    before = list(sys.meta_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        yield module
    finally:
        sys.meta_path[:] = before  # loading it installed its import hook in this process


def patched(shim: Any) -> type[Shipped]:
    cls = type("StageDiffusionClient", (Shipped,), {})
    module = types.ModuleType("vllm_omni.diffusion.stage_diffusion_client")
    module.StageDiffusionClient = cls  # type: ignore[attr-defined]
    shim._PATCHES[module.__name__](module)
    return cls


def connected(cls: type[Shipped]) -> tuple[Shipped, zmq.Context[Any], zmq.Socket[Any]]:
    client = cls()
    ctx: zmq.Context[Any] = zmq.Context()
    replica = ctx.socket(zmq.PULL)
    replica.connect(client.request_address)
    client._request_socket.send(b"hello")
    assert replica.recv() == b"hello"
    return client, ctx, replica


def test_detaching_a_replica_that_already_left_returns_at_once(shim: Any) -> None:
    client, ctx, replica = connected(patched(shim))
    events = client._request_socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    events.setsockopt(zmq.RCVTIMEO, 5000)
    replica.close(linger=0)
    ctx.term()
    assert recv_monitor_message(events)["event"] == zmq.EVENT_DISCONNECTED
    client._request_socket.disable_monitor()
    events.close(linger=0)
    done = threading.Thread(target=client.shutdown, daemon=True)
    done.start()
    done.join(timeout=5)
    assert not done.is_alive(), "shutdown() blocked on a send to a replica that is gone"


def test_a_replica_still_listening_still_gets_the_shutdown_message(shim: Any) -> None:
    client, ctx, replica = connected(patched(shim))
    client.shutdown()
    replica.setsockopt(zmq.RCVTIMEO, 2000)
    assert replica.recv() == b"shutdown"
    replica.close(linger=0)
    ctx.term()
