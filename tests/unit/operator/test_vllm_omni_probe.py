"""The replica pods' probe script (podfiles/omnimodel_probe.py), run as the kubelet runs it: a process
whose exit status is the verdict, against a head that answers, forgets this pod, or does not answer."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import omnimodel_operator.vllm_omni.podfiles as podfiles

PROBE = Path(podfiles.__file__).parent / "omnimodel_probe.py"
POD_IP = "10.244.0.7"


@pytest.fixture
def head() -> Iterator[tuple[str, list[dict[str, object]]]]:
    """A head's ``GET /omnimodel/replicas`` with stage 1's rows (the list is the test's to change)."""
    rows: list[dict[str, object]] = []

    class Replicas(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps({"stages": {"1": rows}}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Replicas)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", rows
    finally:
        server.shutdown()
        server.server_close()


def probe(mode: str, head_url: str) -> subprocess.CompletedProcess[str]:
    env = {"POD_IP": POD_IP, "OMNIMODEL_STAGE_ID": "1", "OMNIMODEL_HEAD_URL": head_url}
    return subprocess.run(
        [sys.executable, str(PROBE), mode], env=env, capture_output=True, text=True, timeout=30, check=False
    )


def test_a_registered_replica_is_live_and_ready_until_the_head_forgets_it(
    head: tuple[str, list[dict[str, object]]],
) -> None:
    url, rows = head
    # Registered but not attached yet (loading, or waiting for the handshake): still starting.
    started = probe("started", url)
    assert started.returncode == 1 and "not registered" in started.stderr
    rows.append({"host": POD_IP, "up": True, "draining": False, "inFlight": 0})
    assert probe("started", url).returncode == 0
    assert probe("live", url).returncode == 0
    assert probe("ready", url).returncode == 0
    rows[0]["draining"] = True
    assert probe("live", url).returncode == 0
    assert probe("ready", url).returncode == 1
    rows.clear()  # detached: 0.30 never takes it back, so only a restart registers it again
    live = probe("live", url)
    assert live.returncode == 1 and "not registered" in live.stderr


def test_a_head_that_does_not_answer_fails_startup_and_readiness_but_not_liveness() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    ready = probe("ready", url)
    assert ready.returncode == 1 and "the head did not answer" in ready.stderr
    # A replica has started once a head attached it: passing here would hand a replica that no head has
    # yet to liveness, which kills it when the head comes up without it.
    assert probe("started", url).returncode == 1
    # Restarting the replica would only fail what it holds: the head is what is down.
    assert probe("live", url).returncode == 0
