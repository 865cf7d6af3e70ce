"""A stage replica that stops answering (SIGSTOP: its socket still accepts, nothing replies) is taken out of
the gateway's pool as soon as a health probe times out; requests go to the other replica, or fail fast with
a 503 naming the stage when none is left, and a replica that answers again is used again. Real processes:
two ``omnimodel stage`` replicas of the tiny text model behind one ``omnimodel gateway``."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from runtime_procs import (
    RuntimeProcess,
    free_port,
    gateway_process,
    pipeline_file,
    running,
    runtime_env,
    stage_process,
    wait_for,
)

from omnimodel_runtime.serve import serve_pipeline

pytestmark = [pytest.mark.engine]

HEALTH_INTERVAL = 0.5
HEALTH_TIMEOUT = 1.0
ASK = {"model": "text", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def replicas(
    tmp_path_factory: pytest.TempPathFactory, model_cache: Path, tiny_text: Path
) -> Iterator[tuple[RuntimeProcess, RuntimeProcess, RuntimeProcess]]:
    tmp = tmp_path_factory.mktemp("failover")
    ports = free_port(), free_port()
    pipeline = serve_pipeline("text", "tiny://text", engines=["transformers"], device="cpu")
    path = pipeline_file(pipeline, {"llm": ports}, tmp / "pipeline.json")
    env = runtime_env(model_cache, OMNIMODEL_HEALTH_INTERVAL=HEALTH_INTERVAL, OMNIMODEL_HEALTH_TIMEOUT=HEALTH_TIMEOUT)
    a, b = (stage_process(path, "llm", p, log_dir=tmp, env=env) for p in ports)
    gateway = gateway_process(path, log_dir=tmp, env=env)
    with running(a, b, gateway):
        try:
            a.wait_healthy()
            b.wait_healthy()
            gateway.wait_healthy()
            yield a, b, gateway
        finally:
            for p in (a, b):  # a stopped process would sit out SIGTERM until SIGKILL
                if p.alive:
                    p.signal(signal.SIGCONT)


def _endpoints(gateway: RuntimeProcess) -> dict[str, dict[str, Any]]:
    resp = gateway.get("/health")
    assert resp is not None
    return {e["url"]: e for e in resp.json()["stages"]["llm"]["endpoints"]}


def _healthy(gateway: RuntimeProcess, replica: RuntimeProcess) -> bool:
    return bool(_endpoints(gateway)[replica.url]["healthy"])


def _ask(gateway: RuntimeProcess, **extra: Any) -> tuple[int, float, dict[str, Any]]:
    started = time.monotonic()
    resp = httpx.post(f"{gateway.url}/v1/chat/completions", json={**ASK, **extra}, timeout=60)
    return resp.status_code, time.monotonic() - started, resp.json()


@pytest.mark.slow
def test_a_stopped_replica_is_skipped_then_none_left_is_a_fast_503_then_both_come_back(
    replicas: tuple[RuntimeProcess, RuntimeProcess, RuntimeProcess],
) -> None:
    a, b, gateway = replicas
    assert {_ask(gateway)[0] for _ in range(4)} == {200}

    # Requests running when a replica stops. Non-streamed: nothing reaches the client before the end, so
    # one on the stopped replica can start again on the other. (Usually one lands on each replica; on a
    # loaded machine a slow probe may briefly take one out of the pool, and both go to the other.)
    results: list[tuple[int, float, dict[str, Any]]] = []
    threads = [
        threading.Thread(target=lambda: results.append(_ask(gateway, max_tokens=1500, ignore_eos=True)))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    wait_for(lambda: sum(e["in_flight"] for e in _endpoints(gateway).values()) == 2, timeout=20, what="both in flight")
    busy = _endpoints(gateway)
    victim, survivor = (a, b) if busy[a.url]["in_flight"] else (b, a)

    stopped = time.monotonic()
    victim.signal(signal.SIGSTOP)
    wait_for(lambda: not _healthy(gateway, victim), timeout=10, what="the gateway to see the stopped replica")
    detected = time.monotonic()
    # Out of the pool after one unanswered probe: at most a poll interval plus the health timeout.
    assert detected - stopped < HEALTH_INTERVAL + HEALTH_TIMEOUT + 0.5
    status, took, _ = _ask(gateway)
    assert status == 200
    assert time.monotonic() - detected < 1.0, f"a request after detection took {took:.2f} s"
    print(f"stop detected after {detected - stopped:.2f} s; the next request took {took:.2f} s")
    assert {_ask(gateway)[0] for _ in range(5)} == {200}
    assert _healthy(gateway, survivor)
    for t in threads:
        t.join(timeout=60)
    assert [r[0] for r in results] == [200, 200], results
    print(f"the two requests running at the stop took {sorted(round(r[1], 2) for r in results)} s")

    # The last replica stops: a request sent before the gateway noticed waits for the detection at most,
    # and one sent after is refused at once. Both are a 503 that names the stage.
    survivor.signal(signal.SIGSTOP)
    status, took, body = _ask(gateway)
    assert status == 503, body
    assert took <= 5.0
    print(f"last replica stopped: 503 after {took:.2f} s")
    assert "stage 'llm'" in body["error"]["message"]
    status, took, body = _ask(gateway)
    assert status == 503
    assert took <= 1.0, f"took {took:.2f} s"
    print(f"none left, known: 503 after {took:.2f} s ({body['error']['message']})")
    health = gateway.get("/health")
    assert health is not None
    assert health.status_code == 503

    # Both answer again: both are back in the pool.
    a.signal(signal.SIGCONT)
    b.signal(signal.SIGCONT)
    wait_for(lambda: _healthy(gateway, a) and _healthy(gateway, b), timeout=10, what="both replicas back")
    assert {_ask(gateway)[0] for _ in range(4)} == {200}
    in_flight = _endpoints(gateway)
    assert all(e["in_flight"] == 0 for e in in_flight.values())
