"""Kubernetes writes (and the few reads the watch-fed cache cannot answer) behind a small interface.

Watching is kopf's job (its watch streams feed the controller's cache); what is left is six verbs on a
handful of kinds: server-side apply, get, list, delete, a status patch and Events. A thin async client
over the REST API does exactly that, and component tests run the same reconcile against the in-memory
fake in ``tests/support``.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import ssl
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol

import httpx
import yaml

Manifest = dict[str, Any]

# (apiVersion, kind) → (plural, namespaced). Only what the operator touches.
RESOURCES: Final[Mapping[tuple[str, str], tuple[str, bool]]] = {
    ("v1", "ConfigMap"): ("configmaps", True),
    ("v1", "Service"): ("services", True),
    ("v1", "Pod"): ("pods", True),
    ("v1", "Event"): ("events", True),
    ("v1", "Secret"): ("secrets", True),
    ("v1", "ServiceAccount"): ("serviceaccounts", True),
    ("apps/v1", "Deployment"): ("deployments", True),
    ("autoscaling/v2", "HorizontalPodAutoscaler"): ("horizontalpodautoscalers", True),
    ("policy/v1", "PodDisruptionBudget"): ("poddisruptionbudgets", True),
    ("networking.k8s.io/v1", "NetworkPolicy"): ("networkpolicies", True),
    ("batch/v1", "Job"): ("jobs", True),
    ("v1", "PersistentVolumeClaim"): ("persistentvolumeclaims", True),
    ("omnimodel.io/v1alpha1", "OmniModel"): ("omnimodels", True),
}

_IN_CLUSTER_DIR: Final = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class ApiError(Exception):
    """A failed API call; ``transient`` says whether retrying may help."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        self.status = status
        self.reason = reason
        self.message = message
        super().__init__(f"{status} {reason}: {message}")

    @property
    def transient(self) -> bool:
        return self.status in (0, 409, 429) or self.status >= 500


class KubeClient(Protocol):
    """What reconcile needs from Kubernetes."""

    async def apply(self, manifest: Manifest, field_manager: str) -> Manifest: ...

    async def list(self, api_version: str, kind: str, namespace: str, labels: Mapping[str, str]) -> list[Manifest]: ...

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> Manifest | None: ...

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None: ...

    async def patch_status(
        self, api_version: str, kind: str, namespace: str, name: str, status: Mapping[str, Any]
    ) -> Manifest: ...

    async def create(self, manifest: Manifest) -> Manifest: ...

    async def scale(
        self, api_version: str, kind: str, namespace: str, name: str, replicas: int, field_manager: str
    ) -> Manifest: ...


def _path(api_version: str, kind: str, namespace: str, name: str | None = None) -> str:
    plural, namespaced = RESOURCES[(api_version, kind)]
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    # An empty namespace on a namespaced kind means "across all namespaces" (list only).
    ns = f"/namespaces/{namespace}" if namespaced and namespace else ""
    return f"{base}{ns}/{plural}" + (f"/{name}" if name else "")


def _selector(labels: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


# --------------------------------------------------------------------------------------- real client


@dataclass
class Connection:
    server: str
    verify: ssl.SSLContext | bool
    headers: dict[str, str] = field(default_factory=dict)


def _materialise(data: str | None, path: str | None, tmp: Path, name: str) -> str | None:
    """kubeconfigs carry certs inline (*-data, base64) or as paths; ssl wants files."""
    if data:
        target = tmp / name
        target.write_bytes(base64.b64decode(data))
        target.chmod(0o600)
        return str(target)
    return path


def load_connection(kubeconfig: str | None = None) -> Connection:
    """In-cluster service account when running in a pod, else the kubeconfig's current context."""
    path = kubeconfig or os.environ.get("KUBECONFIG")
    if not path and (_IN_CLUSTER_DIR / "token").exists():
        host = os.environ["KUBERNETES_SERVICE_HOST"]
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        ctx = ssl.create_default_context(cafile=str(_IN_CLUSTER_DIR / "ca.crt"))
        token = (_IN_CLUSTER_DIR / "token").read_text().strip()
        return Connection(f"https://{host}:{port}", ctx, {"Authorization": f"Bearer {token}"})
    path = path or str(Path.home() / ".kube" / "config")
    config = yaml.safe_load(Path(path).read_text())
    current = config.get("current-context")
    context = next(c["context"] for c in config["contexts"] if c["name"] == current)
    cluster = next(c["cluster"] for c in config["clusters"] if c["name"] == context["cluster"])
    user: dict[str, Any] = next((u["user"] for u in config.get("users", []) if u["name"] == context.get("user")), {})
    tmp = Path(tempfile.mkdtemp(prefix="omnimodel-kube-"))
    base = Path(path).parent

    def rel(p: str | None) -> str | None:
        return str(base / p) if p and not os.path.isabs(p) else p

    verify: ssl.SSLContext | bool = True
    if cluster.get("insecure-skip-tls-verify"):
        verify = False
    else:
        ca = _materialise(
            cluster.get("certificate-authority-data"), rel(cluster.get("certificate-authority")), tmp, "ca"
        )
        verify = ssl.create_default_context(cafile=ca) if ca else ssl.create_default_context()
    cert = _materialise(user.get("client-certificate-data"), rel(user.get("client-certificate")), tmp, "crt")
    key = _materialise(user.get("client-key-data"), rel(user.get("client-key")), tmp, "key")
    if cert and key and isinstance(verify, ssl.SSLContext):
        verify.load_cert_chain(cert, key)
    headers = {"Authorization": f"Bearer {user['token']}"} if user.get("token") else {}
    return Connection(cluster["server"], verify, headers)


class HttpKube:
    """The real client: REST over httpx, one connection pool, JSON in and out."""

    def __init__(self, connection: Connection, timeout: float = 30.0, concurrency: int = 16) -> None:
        # One request per pooled connection (HTTP/1.1); the semaphore queues the rest here instead
        # of letting hundreds of concurrent reconciles time out waiting for the pool.
        self._limit = asyncio.Semaphore(concurrency)
        self._client = httpx.AsyncClient(
            base_url=connection.server,
            verify=connection.verify,
            headers={**connection.headers, "Accept": "application/json"},
            timeout=timeout,
            limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency),
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _request(self, method: str, url: str, **kwargs: Any) -> Manifest:
        try:
            async with self._limit:
                resp = await self._client.request(method, url, **kwargs)
        except (httpx.HTTPError, RuntimeError) as err:  # RuntimeError: client closed at shutdown
            raise ApiError(0, type(err).__name__, f"{method} {url}: {err!r}") from err
        if resp.status_code >= 400:
            try:
                body = resp.json()
                raise ApiError(resp.status_code, body.get("reason", ""), body.get("message", resp.text))
            except ValueError:
                raise ApiError(resp.status_code, "", resp.text) from None
        result: Manifest = resp.json()
        return result

    async def apply(self, manifest: Manifest, field_manager: str) -> Manifest:
        meta = manifest["metadata"]
        url = _path(manifest["apiVersion"], manifest["kind"], meta["namespace"], meta["name"])
        return await self._request(
            "PATCH",
            url,
            params={"fieldManager": field_manager, "force": "true"},
            content=json.dumps(manifest),
            headers={"Content-Type": "application/apply-patch+yaml"},
        )

    async def list(self, api_version: str, kind: str, namespace: str, labels: Mapping[str, str]) -> list[Manifest]:
        body = await self._request(
            "GET", _path(api_version, kind, namespace), params={"labelSelector": _selector(labels)}
        )
        items: list[Manifest] = body.get("items", [])
        for item in items:  # list items omit these; builders and callers expect whole objects
            item.setdefault("apiVersion", api_version)
            item.setdefault("kind", kind)
        return items

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> Manifest | None:
        try:
            return await self._request("GET", _path(api_version, kind, namespace, name))
        except ApiError as err:
            if err.status == 404:
                return None
            raise

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        try:
            await self._request(
                "DELETE",
                _path(api_version, kind, namespace, name),
                content=json.dumps({"propagationPolicy": "Background"}),
                headers={"Content-Type": "application/json"},
            )
        except ApiError as err:
            if err.status != 404:
                raise

    async def patch_status(
        self, api_version: str, kind: str, namespace: str, name: str, status: Mapping[str, Any]
    ) -> Manifest:
        return await self._request(
            "PATCH",
            _path(api_version, kind, namespace, name) + "/status",
            content=json.dumps({"status": status}),
            headers={"Content-Type": "application/merge-patch+json"},
        )

    async def scale(
        self, api_version: str, kind: str, namespace: str, name: str, replicas: int, field_manager: str
    ) -> Manifest:
        """Set replicas through the scale subresource (as `kubectl scale` and HPAs do)."""
        return await self._request(
            "PATCH",
            _path(api_version, kind, namespace, name) + "/scale",
            params={"fieldManager": field_manager},
            content=json.dumps({"spec": {"replicas": replicas}}),
            headers={"Content-Type": "application/merge-patch+json"},
        )

    async def create(self, manifest: Manifest) -> Manifest:
        meta = manifest["metadata"]
        return await self._request(
            "POST",
            _path(manifest["apiVersion"], manifest["kind"], meta["namespace"]),
            content=json.dumps(manifest),
            headers={"Content-Type": "application/json"},
        )
