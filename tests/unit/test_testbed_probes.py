"""The test bed kubelet's probes: the prober's state machine and the handlers it runs."""

from __future__ import annotations

import http.server
import socket
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from omnimodel_testbed.probes import ContainerProbes, HandlerTarget, Prober, run_handler


def readiness(**spec: object) -> Prober:
    return Prober("Readiness", {"exec": {"command": ["true"]}, **spec}, started=0.0, result=False)


def test_readiness_starts_unready_and_flips_only_after_its_thresholds() -> None:
    probe = readiness(periodSeconds=5, successThreshold=2, failureThreshold=3)
    assert probe.due(0.0)

    def step(ok: bool, now: float) -> tuple[bool, bool]:
        """(flipped, result) after one probe."""
        return probe.observe(ok, now), probe.result

    assert step(True, 0.0) == (False, False)  # one success of two
    assert not probe.due(4.9) and probe.due(5.0)  # the period
    assert step(True, 5.0) == (True, True)
    assert step(False, 10.0) == step(False, 15.0) == (False, True)  # two failures of three: still ready
    assert step(True, 20.0) == (False, True)  # a success in between starts the count again
    assert step(False, 25.0) == step(False, 30.0) == (False, True)
    assert step(False, 35.0) == (True, False)


def test_nothing_is_probed_before_the_initial_delay() -> None:
    probe = readiness(initialDelaySeconds=3)
    assert not probe.due(2.9) and probe.due(3.0)


def test_a_startup_probe_gates_the_others_and_readiness_follows_it_at_once() -> None:
    container = {
        "startupProbe": {"exec": {"command": ["s"]}, "periodSeconds": 5, "failureThreshold": 10},
        "readinessProbe": {"exec": {"command": ["r"]}, "periodSeconds": 5},
        "livenessProbe": {"exec": {"command": ["l"]}, "periodSeconds": 10},
    }
    probes = ContainerProbes.of(container, started=100.0)
    assert (probes.started, probes.ready) == (False, False)
    assert [p.kind for p in probes.due(100.0)] == ["Startup"]
    assert probes.record(probes.get("Startup"), False, 100.1) == probes.record(probes.get("Startup"), False, 100.1)
    outcome = probes.record(probes.get("Startup"), True, 105.0)
    assert outcome.changed and (probes.started, probes.ready) == (True, False)
    # Readiness runs now, not a period later; the startup probe is done.
    assert [p.kind for p in probes.due(105.0)] == ["Readiness", "Liveness"]
    assert probes.record(probes.get("Readiness"), True, 105.1).changed and probes.ready


def test_a_liveness_failure_kills_once_and_holds_until_the_restart() -> None:
    probes = ContainerProbes.of({"livenessProbe": {"tcpSocket": {"port": 1}, "failureThreshold": 2}}, started=0.0)
    assert probes.ready  # no readiness probe: ready once started
    assert not probes.record(probes.get("Liveness"), False, 0.0).kill
    outcome = probes.record(probes.get("Liveness"), False, 10.0)
    assert outcome.kill and not outcome.changed  # liveness is not readiness
    assert probes.due(100.0) == []  # on hold: no second kill while the first one runs


def test_a_startup_failure_kills_too() -> None:
    probes = ContainerProbes.of({"startupProbe": {"tcpSocket": {"port": 1}, "failureThreshold": 1}}, started=0.0)
    assert probes.record(probes.get("Startup"), False, 0.0).kill


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        code = 200 if self.path == "/ok" and self.headers.get("X-Probe") == "yes" else 503
        self.send_response(code)
        self.end_headers()
        self.wfile.write(b"draining")

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[int]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd.server_address[1]
    finally:
        httpd.shutdown()
        httpd.server_close()


def host(command: Sequence[str]) -> list[str]:
    return list(command)


def test_http_handlers_reach_the_pod_ip_on_a_named_port_with_headers(server: int) -> None:
    target = HandlerTarget("127.0.0.1", {"http": server}, host, {})
    headers = [{"name": "X-Probe", "value": "yes"}]
    assert run_handler({"httpGet": {"path": "/ok", "port": "http", "httpHeaders": headers}}, target, 2) == (True, "")
    assert run_handler({"httpGet": {"path": "/ok", "port": server}}, target, 2) == (
        False,
        "HTTP probe failed with statuscode: 503",
    )
    ok, message = run_handler({"httpGet": {"path": "/drain", "port": server}}, target, 2, hook=True)
    assert not ok and "503" in message and "draining" in message


def test_tcp_and_http_say_what_go_would_when_nothing_listens() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        target = HandlerTarget("127.0.0.1", {}, host, {})
        assert run_handler({"tcpSocket": {"port": port}}, target, 1) == (
            False,
            f"dial tcp 127.0.0.1:{port}: connect: connection refused",
        )
        assert run_handler({"httpGet": {"path": "/health", "port": port}}, target, 1) == (
            False,
            f'Get "http://127.0.0.1:{port}/health": dial tcp 127.0.0.1:{port}: connect: connection refused',
        )


def test_exec_runs_with_the_containers_env_and_reports_its_output(tmp_path: Path) -> None:
    target = HandlerTarget("127.0.0.1", {}, host, {"PATH": "/usr/bin:/bin", "WHO": "pod"}, str(tmp_path))
    assert run_handler({"exec": {"command": ["sh", "-c", 'test "$WHO" = pod']}}, target, 5) == (True, "")
    assert run_handler({"exec": {"command": ["sh", "-c", "echo not yet; exit 1"]}}, target, 5) == (False, "not yet\n")
    ok, message = run_handler({"exec": {"command": ["sleep", "5"]}}, target, 0.2)
    assert not ok and "timed out" in message


def test_a_sleep_hook_is_cut_short_by_its_timeout() -> None:
    target = HandlerTarget("127.0.0.1", {}, host, {})
    stop = threading.Event()
    stop.set()  # the runner is stopping: no waiting at all
    assert run_handler({"sleep": {"seconds": 30}}, target, 30, hook=True, stop=stop) == (True, "")
    assert not run_handler({"sleep": {"seconds": 1}}, target, 30)[0]  # not a probe handler
