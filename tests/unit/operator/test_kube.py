"""The operator's API client (``omnimodel_operator.kube``, lightkube underneath) against a loopback
server that answers as kube-apiserver does: what each verb sends, how refusals map onto ``ApiError``,
and the credentials: an exec plugin run again after a 401, an in-cluster token file re-read after the
kubelet rotates it, and a token that stays refused failing instead of being retried forever."""

from __future__ import annotations

import asyncio
import json
import ssl
import stat
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import yaml

from omnimodel_operator import kube
from omnimodel_operator.kube import ApiError, CredentialsError, LightKube, load_config
from omnimodel_operator.login import connection_info
from omnimodel_testbed.pki import generate_pki


@dataclass
class Seen:
    method: str
    path: str
    query: dict[str, list[str]]
    authorization: str | None
    content_type: str | None
    body: Any


Answer = tuple[int, "dict[str, Any] | str"]


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


UNAUTHORIZED: Answer = (401, status(401, "Unauthorized", "Unauthorized"))


class ApiServer:
    """A loopback stand-in for kube-apiserver: records every request; ``answer`` decides the reply."""

    def __init__(self, answer: Callable[[Seen], Answer], tls: tuple[Path, Path] | None = None) -> None:
        self.seen: list[Seen] = []
        self.answer = answer
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _handle(self) -> None:
                url = urlsplit(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                seen = Seen(
                    self.command,
                    url.path,
                    parse_qs(url.query),
                    self.headers.get("Authorization"),
                    self.headers.get("Content-Type"),
                    json.loads(raw) if raw else None,
                )
                server.seen.append(seen)
                code, reply = server.answer(seen)
                data = reply.encode() if isinstance(reply, str) else json.dumps(reply).encode()
                self.send_response(code)
                self.send_header(
                    "Content-Type", "text/plain; charset=utf-8" if isinstance(reply, str) else "application/json"
                )
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._handle()

            def do_POST(self) -> None:
                self._handle()

            def do_PATCH(self) -> None:
                self._handle()

            def do_DELETE(self) -> None:
                self._handle()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        scheme = "http"
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
            scheme = "https"
        self.port = self.server.server_address[1]
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


@pytest.fixture
def servers() -> Iterator[Callable[..., ApiServer]]:
    started: list[ApiServer] = []

    def start(answer: Callable[[Seen], Answer], tls: tuple[Path, Path] | None = None) -> ApiServer:
        started.append(ApiServer(answer, tls))
        return started[-1]

    yield start
    for s in started:
        s.close()


def kubeconfig(path: Path, server: str, user: dict[str, Any], cluster: dict[str, Any] | None = None) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": server, **(cluster or {})}}],
                "users": [{"name": "u", "user": user}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u", "namespace": "ml"}}],
                "current-context": "x",
            }
        )
    )
    return path


def exec_plugin(tmp_path: Path) -> tuple[dict[str, Any], Path, Path]:
    """An exec credential plugin (as `aws eks get-token` or kubelogin are) that prints the token in
    ``token`` and appends a line to ``runs`` each time it is run. Returns the kubeconfig user."""
    token, runs = tmp_path / "token", tmp_path / "runs"
    script = tmp_path / "credential-plugin"
    script.write_text(
        "#!/bin/sh\n"
        'echo run >> "$RUNS"\n'
        'printf \'{"apiVersion":"client.authentication.k8s.io/v1beta1","kind":"ExecCredential",'
        '"status":{"token":"%s"}}\' "$(cat "$TOKEN")"\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    user = {
        "exec": {
            "apiVersion": "client.authentication.k8s.io/v1beta1",
            "command": str(script),
            "env": [{"name": "TOKEN", "value": str(token)}, {"name": "RUNS", "value": str(runs)}],
        }
    }
    return user, token, runs


def accepting(valid: Callable[[], str], ok: Answer) -> Callable[[Seen], Answer]:
    """Answers ``ok`` to requests bearing the token ``valid()`` returns now, 401 to any other."""
    return lambda seen: ok if seen.authorization == f"Bearer {valid()}" else UNAUTHORIZED


EMPTY_LIST: Answer = (200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": []})


def runs(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


# ------------------------------------------------------------------------------------------ verbs


async def test_each_verb_sends_the_request_kube_apiserver_expects(
    servers: Callable[..., ApiServer], tmp_path: Path
) -> None:
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "qwen-talker", "namespace": "ml"},
        "spec": {"replicas": 2},
    }

    def answer(seen: Seen) -> Answer:
        if seen.method == "GET" and seen.path.endswith("/pods"):
            item = {"metadata": {"name": "p", "namespace": "ml", "labels": {"a": "b"}}}
            return 200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": [item]}
        if seen.method == "DELETE":
            return 200, {"kind": "Status", "apiVersion": "v1", "status": "Success"}
        body = seen.body if isinstance(seen.body, dict) else {}
        return 200, {"apiVersion": "v1", "kind": "X", "metadata": {"name": "n", "namespace": "ml"}, **body}

    server = servers(answer)
    client = LightKube(load_config(str(kubeconfig(tmp_path / "kc", server.url, {"token": "t0"}))))
    try:
        applied = await client.apply(deployment, "omnimodel-operator")
        pods = await client.list("v1", "Pod", "ml", {"a": "b", "c": "d"})
        await client.list("v1", "Pod", "", {})
        await client.delete("apps/v1", "Deployment", "ml", "qwen-talker")
        await client.patch_status("omnimodel.io/v1alpha1", "OmniModel", "ml", "qwen", {"phase": None, "x": 1})
        await client.scale("apps/v1", "Deployment", "ml", "qwen-talker", 3, "omnimodel-autoscaler")
        event = {"apiVersion": "v1", "kind": "Event", "metadata": {"generateName": "qwen-", "namespace": "ml"}}
        await client.create(event)
    finally:
        await client.aclose()

    assert applied["spec"] == {"replicas": 2} and type(applied) is dict
    # List items come back whole (the API server leaves apiVersion and kind off items).
    assert pods == [
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "ml", "labels": {"a": "b"}}}
    ]
    apply, listed, all_ns, delete, status_patch, scale, create = server.seen
    assert (apply.method, apply.path) == ("PATCH", "/apis/apps/v1/namespaces/ml/deployments/qwen-talker")
    assert apply.query == {"fieldManager": ["omnimodel-operator"], "force": ["true"]}
    assert apply.content_type == "application/apply-patch+yaml" and apply.body == deployment
    assert (listed.path, listed.query) == ("/api/v1/namespaces/ml/pods", {"labelSelector": ["a=b,c=d"]})
    assert (all_ns.path, all_ns.query) == ("/api/v1/pods", {})
    assert (delete.method, delete.path) == ("DELETE", "/apis/apps/v1/namespaces/ml/deployments/qwen-talker")
    assert delete.query == {"propagationPolicy": ["Background"]}
    assert (status_patch.path, status_patch.content_type) == (
        "/apis/omnimodel.io/v1alpha1/namespaces/ml/omnimodels/qwen/status",
        "application/merge-patch+json",
    )
    assert status_patch.body == {"status": {"phase": None, "x": 1}}  # null removes a field
    assert (scale.path, scale.query) == (
        "/apis/apps/v1/namespaces/ml/deployments/qwen-talker/scale",
        {"fieldManager": ["omnimodel-autoscaler"]},
    )
    assert scale.body == {"spec": {"replicas": 3}}
    assert (create.method, create.path, create.body) == ("POST", "/api/v1/namespaces/ml/events", event)
    assert {s.authorization for s in server.seen} == {"Bearer t0"}


@pytest.mark.parametrize(
    ("answer", "expected", "transient"),
    [
        ((409, status(409, "Conflict", "the object has been modified")), (409, "Conflict"), True),
        ((422, status(422, "Invalid", "spec.replicas: Invalid value")), (422, "Invalid"), False),
        ((403, status(403, "Forbidden", "cannot patch deployments")), (403, "Forbidden"), False),
        ((503, status(503, "ServiceUnavailable", "etcd not ready")), (503, "ServiceUnavailable"), True),
        ((429, status(429, "TooManyRequests", "slow down")), (429, "TooManyRequests"), True),
        # What kube-apiserver answers for a resource it does not serve (a CRD not installed yet).
        ((404, "404 page not found\n"), (404, ""), False),
    ],
)
async def test_refusals_keep_the_api_servers_code_reason_and_message(
    servers: Callable[..., ApiServer], tmp_path: Path, answer: Answer, expected: tuple[int, str], transient: bool
) -> None:
    server = servers(lambda _: answer)
    client = LightKube(load_config(str(kubeconfig(tmp_path / "kc", server.url, {"token": "t"}))))
    try:
        with pytest.raises(ApiError) as err:
            await client.apply(
                {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s", "namespace": "ml"}}, "m"
            )
    finally:
        await client.aclose()
    assert (err.value.status, err.value.reason) == expected
    body = answer[1]
    assert err.value.message == (body if isinstance(body, str) else body["message"])
    assert err.value.transient is transient
    assert len(server.seen) == 1  # the client itself retries nothing: reconcile decides


async def test_not_found_is_none_for_get_and_done_for_delete(servers: Callable[..., ApiServer], tmp_path: Path) -> None:
    server = servers(lambda _: (404, status(404, "NotFound", 'deployments.apps "x" not found')))
    client = LightKube(load_config(str(kubeconfig(tmp_path / "kc", server.url, {"token": "t"}))))
    try:
        assert await client.get("apps/v1", "Deployment", "ml", "x") is None
        await client.delete("apps/v1", "Deployment", "ml", "x")
        with pytest.raises(ApiError) as err:
            await client.patch_status("omnimodel.io/v1alpha1", "OmniModel", "ml", "x", {})
    finally:
        await client.aclose()
    assert (err.value.status, err.value.reason) == (404, "NotFound")


async def test_an_unreachable_server_is_a_transient_error(tmp_path: Path) -> None:
    client = LightKube(load_config(str(kubeconfig(tmp_path / "kc", "http://127.0.0.1:9", {"token": "t"}))))
    try:
        with pytest.raises(ApiError) as err:
            await client.get("v1", "Pod", "ml", "p")
    finally:
        await client.aclose()
    assert (err.value.status, err.value.reason, err.value.transient) == (0, "ConnectError", True)


# ------------------------------------------------------------------------------------ credentials


async def test_an_exec_plugin_runs_once_and_again_when_its_token_is_refused(
    servers: Callable[..., ApiServer], tmp_path: Path
) -> None:
    user, token, ran = exec_plugin(tmp_path)
    token.write_text("first")
    server = servers(accepting(token.read_text, EMPTY_LIST))
    client = LightKube(load_config(str(kubeconfig(tmp_path / "kc", server.url, user))))
    try:
        await client.list("v1", "Pod", "ml", {})
        await client.list("v1", "Pod", "ml", {})
        assert runs(ran) == 1  # the token is kept while the API server takes it
        token.write_text("second")  # rotated: the API server now refuses "first"
        await client.list("v1", "Pod", "ml", {})
    finally:
        await client.aclose()
    assert runs(ran) == 2
    assert [s.authorization for s in server.seen] == ["Bearer first"] * 3 + ["Bearer second"]


async def test_a_token_that_stays_refused_fails_after_one_fresh_try(
    servers: Callable[..., ApiServer], tmp_path: Path
) -> None:
    user, token, ran = exec_plugin(tmp_path)
    token.write_text("revoked")
    server = servers(lambda _: UNAUTHORIZED)
    client = LightKube(load_config(str(kubeconfig(tmp_path / "kc", server.url, user))))
    try:
        for _ in range(2):
            with pytest.raises(ApiError) as err:
                await client.list("v1", "Pod", "ml", {})
            assert (err.value.status, err.value.reason) == (401, "Unauthorized")
    finally:
        await client.aclose()
    # Each call sends twice, the second time with the plugin's fresh token, then fails. Never a loop.
    assert (len(server.seen), runs(ran)) == (4, 3)


async def test_concurrent_requests_share_one_plugin_run(servers: Callable[..., ApiServer], tmp_path: Path) -> None:
    """A reconcile sends its writes at once: one plugin run serves them all, at start and after a 401."""
    user, token, ran = exec_plugin(tmp_path)
    token.write_text("first")
    server = servers(accepting(token.read_text, EMPTY_LIST))
    client = LightKube(load_config(str(kubeconfig(tmp_path / "kc", server.url, user))))
    try:
        await asyncio.gather(*(client.list("v1", "Pod", "ml", {}) for _ in range(8)))
        assert runs(ran) == 1
        token.write_text("second")
        await asyncio.gather(*(client.list("v1", "Pod", "ml", {}) for _ in range(8)))
    finally:
        await client.aclose()
    assert runs(ran) == 2
    assert [s.authorization for s in server.seen].count("Bearer second") == 8


async def test_an_exec_plugin_that_fails_is_a_credentials_error_with_its_words(
    servers: Callable[..., ApiServer], tmp_path: Path
) -> None:
    server = servers(lambda _: EMPTY_LIST)
    plugin = ["sh", "-c", "echo token expired, run aws sso login >&2; exit 1"]
    user = {"exec": {"apiVersion": "client.authentication.k8s.io/v1beta1", "command": plugin[0], "args": plugin[1:]}}
    client = LightKube(load_config(str(kubeconfig(tmp_path / "kc", server.url, user))))
    try:
        with pytest.raises(CredentialsError) as err:
            await client.list("v1", "Pod", "ml", {})
    finally:
        await client.aclose()
    assert "token expired, run aws sso login" in err.value.message
    assert err.value.transient and server.seen == []


@pytest.fixture
def in_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, servers: Callable[..., ApiServer]) -> ApiServer:
    """A pod's view: the ServiceAccount directory, KUBERNETES_SERVICE_*, and an API server over TLS
    (its certificate from the CA in ca.crt), which takes only the token now in the directory."""
    pki = generate_pki(tmp_path / "pki", service_ip="10.96.0.1")
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "ca.crt").write_bytes(pki.ca_cert.read_bytes())
    (account / "namespace").write_text("omnimodel-system")
    (account / "token").write_text("projected-1")
    server = servers(accepting((account / "token").read_text, EMPTY_LIST), tls=(pki.apiserver_cert, pki.apiserver_key))
    monkeypatch.setattr(kube, "_IN_CLUSTER_DIR", account)
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(server.port))
    return server


async def test_the_in_cluster_token_is_read_again_after_the_kubelet_rotates_it(in_cluster: ApiServer) -> None:
    cluster = load_config()
    assert cluster.source.startswith("the in-cluster service account")
    assert cluster.server == f"https://127.0.0.1:{in_cluster.port}"
    client = LightKube(cluster)
    try:
        await client.list("v1", "Pod", "ml", {})
        (kube._IN_CLUSTER_DIR / "token").write_text("projected-2")  # the kubelet's atomic swap, in effect
        await client.list("v1", "Pod", "ml", {})
        await client.list("v1", "Pod", "ml", {})
    finally:
        await client.aclose()
    assert [s.authorization for s in in_cluster.seen] == [
        "Bearer projected-1",
        "Bearer projected-1",  # refused: the file is read again
        "Bearer projected-2",
        "Bearer projected-2",
    ]


def test_kubeconfig_wins_over_the_in_cluster_account_which_wins_over_home(
    in_cluster: ApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home" / ".kube"
    home.mkdir(parents=True)
    kubeconfig(home / "config", "http://home.example", {"token": "h"})
    assert load_config().server.startswith("https://127.0.0.1:")
    explicit = kubeconfig(tmp_path / "kc", "http://explicit.example", {"token": "e"})
    monkeypatch.setenv("KUBECONFIG", str(explicit))
    assert (load_config().server, load_config().source) == ("http://explicit.example", f"KUBECONFIG={explicit}")
    monkeypatch.delenv("KUBECONFIG")
    (kube._IN_CLUSTER_DIR / "token").unlink()
    assert (load_config().server, load_config().source) == ("http://home.example", str(home / "config"))


def test_a_legacy_auth_provider_is_refused_when_the_config_is_read(tmp_path: Path) -> None:
    user = {"auth-provider": {"name": "oidc", "config": {"id-token": "x", "idp-issuer-url": "https://idp"}}}
    with pytest.raises(Exception, match=r"auth-provider \(oidc\) is not supported.*kubelogin"):
        load_config(str(kubeconfig(tmp_path / "kc", "http://x", user)))


# --------------------------------------------------------------------------------- kopf's login


async def test_kopfs_login_gets_fresh_credentials_from_the_same_config(tmp_path: Path) -> None:
    user, token, ran = exec_plugin(tmp_path)
    (tmp_path / "certs").mkdir()
    user = {**user, "client-certificate": "certs/me.crt", "client-key": "certs/me.key"}
    cluster = {"certificate-authority": "certs/ca.crt"}
    config = load_config(str(kubeconfig(tmp_path / "kc", "https://api.example:6443", user, cluster)))
    token.write_text("first")
    first = await connection_info(config, trust_env=True)
    token.write_text("second")
    second = await connection_info(config)
    # kopf calls its login again after a 401: each call must bring the plugin's current token.
    assert (first.scheme, first.token, second.token, runs(ran)) == ("Bearer", "first", "second", 2)
    assert first.server == "https://api.example:6443" and first.default_namespace == "ml" and first.trust_env
    # Paths in a kubeconfig are relative to its own directory, as kubectl reads them.
    assert (first.ca_path, first.certificate_path, first.private_key_path) == tuple(
        str(tmp_path / "certs" / name) for name in ("ca.crt", "me.crt", "me.key")
    )


async def test_kopfs_login_passes_inline_certificates_and_no_token(tmp_path: Path) -> None:
    user = {"client-certificate-data": "Y2VydA==", "client-key-data": "a2V5"}
    config = load_config(
        str(kubeconfig(tmp_path / "kc", "https://api:6443", user, {"certificate-authority-data": "Y2E="}))
    )
    info = await connection_info(config)
    assert (info.token, info.ca_data, info.certificate_data, info.private_key_data) == (
        None,
        "Y2E=",
        "Y2VydA==",
        "a2V5",
    )
