"""`omnimodel-operator run` as a user starts it, without a usable cluster: it exits non-zero within
seconds and says why, instead of retrying kopf's start-up every minute with ``/healthz`` never up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

OPERATOR = Path(sys.executable).parent / "omnimodel-operator"
# What a pod's restart policy and probes tolerate before anything but a crash is visible.
EXIT_WITHIN = 30.0


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    """A Kubernetes ``Status``, as the API server answers a refused request."""
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


class ApiAnswer:
    """A loopback HTTP server that answers every request alike: a ``Status`` (JSON) or plain text."""

    def __init__(self, code: int, answer: dict[str, Any] | str) -> None:
        self.requests: list[str] = []
        plain = isinstance(answer, str)
        body = (answer if isinstance(answer, str) else json.dumps(answer)).encode()
        requests = self.requests

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                requests.append(self.path)
                self.send_response(code)
                self.send_header("Content-Type", "text/plain; charset=utf-8" if plain else "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


StartServer = Callable[[int, "dict[str, Any] | str"], ApiAnswer]


@pytest.fixture
def api_server() -> Iterator[StartServer]:
    servers: list[ApiAnswer] = []

    def start(code: int, answer: dict[str, Any] | str) -> ApiAnswer:
        servers.append(ApiAnswer(code, answer))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def kubeconfig(path: Path, server: str) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": server}}],
                "users": [{"name": "u", "user": {"token": "not-a-valid-token"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    return path


def run_operator(home: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], float]:
    """The installed console script, in an environment of nothing but ``HOME`` and ``env`` (and
    PYTHONPATH, which points a worktree's run at its own checkout)."""
    home.mkdir(exist_ok=True)
    environ = {"HOME": str(home), **env}
    if "PYTHONPATH" in os.environ:
        environ["PYTHONPATH"] = os.environ["PYTHONPATH"]
    started = time.monotonic()
    # subprocess.run kills the operator and raises TimeoutExpired if it is still retrying by then.
    result = subprocess.run(
        [str(OPERATOR), "run", "--liveness", "http://127.0.0.1:0/healthz"],
        env=environ,
        capture_output=True,
        text=True,
        timeout=EXIT_WITHIN,
        check=False,
    )
    return result, time.monotonic() - started


def test_without_any_cluster_config_it_exits_at_once_naming_where_it_looked(tmp_path: Path) -> None:
    home = tmp_path / "home"
    result, took = run_operator(home)
    assert result.returncode != 0, result.stderr
    assert took < EXIT_WITHIN
    (line,) = [line for line in result.stderr.splitlines() if "Cannot start" in line]
    assert "no Kubernetes cluster config" in line
    assert "KUBERNETES_SERVICE_HOST unset" in line
    assert "/var/run/secrets/kubernetes.io/serviceaccount/token" in line
    assert "KUBECONFIG unset" in line
    assert f"{home}/.kube/config absent" in line


@pytest.mark.parametrize(
    ("code", "reason", "message"),
    [
        (401, "Unauthorized", "token rejected by the test's API server"),
        (
            403,
            "Forbidden",
            'omnimodels.omnimodel.io is forbidden: User "u" cannot list resource "omnimodels" in API group '
            '"omnimodel.io" at the cluster scope',
        ),
    ],
)
def test_refused_credentials_exit_at_once_in_the_api_servers_words(
    tmp_path: Path, api_server: StartServer, code: int, reason: str, message: str
) -> None:
    server = api_server(code, status(code, reason, message))
    config = kubeconfig(tmp_path / "kubeconfig", server.url)
    result, took = run_operator(tmp_path / "home", KUBECONFIG=str(config))
    assert result.returncode != 0, result.stderr
    assert took < EXIT_WITHIN
    (line,) = [line for line in result.stderr.splitlines() if "Cannot start" in line]
    assert f"the API server at {server.url} refused the credentials from KUBECONFIG={config}" in line
    assert f"{code} {reason}: {message}" in line
    # Refused is final: one request, no retries.
    assert server.requests == ["/apis/omnimodel.io/v1alpha1/omnimodels"]


@pytest.mark.parametrize(
    ("code", "answer", "said"),
    [
        (
            503,
            status(503, "ServiceUnavailable", "etcd not ready in the test's API server"),
            "503 ServiceUnavailable: etcd not ready in the test's API server",
        ),
        # What a real API server answers for a resource it does not serve yet, newline included.
        (404, "404 page not found\n", "404 : 404 page not found (is the omnimodels.omnimodel.io CRD installed?)"),
    ],
)
def test_an_api_server_not_ready_is_retried_for_the_startup_timeout_then_named(
    tmp_path: Path, api_server: StartServer, code: int, answer: dict[str, Any] | str, said: str
) -> None:
    # A short bound so the test does not wait out the shipped 30 s; the retry path is the same.
    server = api_server(code, answer)
    config = kubeconfig(tmp_path / "kubeconfig", server.url)
    result, took = run_operator(tmp_path / "home", KUBECONFIG=str(config), OMNIMODEL_API_STARTUP_TIMEOUT="1")
    assert result.returncode != 0, result.stderr
    assert took < EXIT_WITHIN
    (line,) = [line for line in result.stderr.splitlines() if "Cannot start" in line]
    assert "could not list omnimodels.omnimodel.io cluster-wide within 1 s (OMNIMODEL_API_STARTUP_TIMEOUT)" in line
    assert line.endswith(said)
    assert len(server.requests) >= 2
