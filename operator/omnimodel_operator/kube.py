"""Kubernetes writes (and the few reads the watch-fed cache cannot answer) behind a small interface.

Watching is kopf's job (its watch streams feed the controller's cache); what is left is a few verbs on a
handful of kinds: server-side apply, get, list, delete, a status patch, a scale and Events. lightkube does
the HTTP and the credentials: kubeconfigs with client certificates, static tokens, token files and exec
credential plugins (how EKS, GKE and AKS log in from outside the cluster), and the in-cluster
ServiceAccount token, re-read when a request is refused with 401 because the kubelet rotated it (an exec
plugin is run again on a 401 likewise). This module maps our verbs onto lightkube's generic resources
(plain dicts in and out, whatever fields the API server returns) and its errors onto ``ApiError``.
Component tests run the same reconcile against the in-memory fake in ``tests/support``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol, TypeVar

import httpx2
from lightkube import ApiError as LightkubeApiError
from lightkube import AsyncClient, ConfigError, KubeConfig
from lightkube.config.client_adapter import user_auth
from lightkube.config.kubeconfig import SingleConfig
from lightkube.config.models import User
from lightkube.generic_resource import GenericNamespacedResource, create_namespaced_resource
from lightkube.types import CascadeType, PatchType

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
# lightkube's "all namespaces" for list; our protocol says it with an empty namespace.
_ALL_NAMESPACES: Final = "*"

T = TypeVar("T")


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


class CredentialsError(ApiError):
    """No request was sent: the credentials could not be had (an exec plugin that failed or printed no
    token, a token file that is gone). Status 0, so a reconcile retries it: a plugin may recover."""

    def __init__(self, message: str) -> None:
        super().__init__(0, "CredentialsError", message)


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


# ------------------------------------------------------------------------------------ cluster config


@dataclass(frozen=True)
class ClusterConfig:
    """The cluster and the user of one kubeconfig context (or of the in-cluster ServiceAccount), and
    where they were read from, for messages."""

    config: SingleConfig
    source: str

    @property
    def server(self) -> str:
        return self.config.cluster.server


def home_kubeconfig() -> Path:
    return Path.home() / ".kube" / "config"


def config_source(kubeconfig: str | None = None) -> str:
    """Where ``load_config`` reads the config from, in its own order, for messages."""
    if kubeconfig:
        return kubeconfig
    if env := os.environ.get("KUBECONFIG"):
        return f"KUBECONFIG={env}"
    if (_IN_CLUSTER_DIR / "token").exists():
        return f"the in-cluster service account ({_IN_CLUSTER_DIR})"
    return str(home_kubeconfig())


def load_config(kubeconfig: str | None = None) -> ClusterConfig:
    """``kubeconfig``, else ``$KUBECONFIG``, else the in-cluster ServiceAccount, else ``~/.kube/config``
    (client-go's order: an explicit kubeconfig wins over the pod's account), at its current context.

    Raises lightkube's ``ConfigError`` (or ``OSError``/``KeyError`` for a broken file) for a config it
    cannot use, an ``auth-provider`` user included: that check runs here, not on the first request."""
    source = config_source(kubeconfig)
    path = kubeconfig or os.environ.get("KUBECONFIG")
    if path:
        loaded = KubeConfig.from_file(path)
    elif (_IN_CLUSTER_DIR / "token").exists():
        loaded = KubeConfig.from_service_account(_IN_CLUSTER_DIR)
    else:
        loaded = KubeConfig.from_file(home_kubeconfig())
    config = loaded.get()
    if config is None:  # get() raises rather than return None without a default; for mypy
        raise ConfigError(f"no current context in {source}")
    if config.user is None:  # a context without a user (a plain-http test server): no credentials
        config = config._replace(user=User())
    assert config.user is not None
    if config.user.auth_provider:
        name = config.user.auth_provider.get("name", "?")
        raise ConfigError(
            f"the user's auth-provider ({name}) is not supported, as in kubectl since 1.26: use the provider's "
            "exec credential plugin (kubelogin for OIDC, gke-gcloud-auth-plugin for GKE)"
        )
    user_auth(config.user)  # raises now, not on the first request, for a user lightkube cannot serve
    return ClusterConfig(config, source)


# ------------------------------------------------------------------------------------------- client

_resources: dict[tuple[str, str], type[GenericNamespacedResource]] = {}


def _resource(api_version: str, kind: str) -> type[GenericNamespacedResource]:
    """lightkube's generic resource for a kind: objects stay plain dicts, nothing is dropped or
    defaulted on the way. Made once per process (lightkube registers each class globally)."""
    key = (api_version, kind)
    if key not in _resources:
        plural, _ = RESOURCES[key]
        group, _, version = api_version.rpartition("/")
        _resources[key] = create_namespaced_resource(group, version, kind, plural)
    return _resources[key]


def _http_error(err: httpx2.HTTPStatusError) -> ApiError:
    """The API server's ``Status`` when it sent one, else the status line and the body as text (a plain
    ``404 page not found`` for a resource it does not serve, a proxy's error page)."""
    if isinstance(err, LightkubeApiError):
        status = err.status
        return ApiError(status.code or err.response.status_code, status.reason or "", status.message or "")
    return ApiError(err.response.status_code, "", err.response.text)


async def authorization_header(user: User, server: str) -> str | None:
    """The ``Authorization`` header lightkube computes for ``user`` now, from a fresh start: an exec
    plugin runs, a token file is read. None for a user without one (client certificates only)."""
    auth = user_auth(user)
    if auth is None:
        return None
    # lightkube's auth flow for one request, driven as its HTTP client would, without sending it.
    flow = auth.async_auth_flow(httpx2.Request("GET", server))
    try:
        request = await anext(flow)
    finally:
        await flow.aclose()
    return request.headers.get("Authorization")


class _SharedExecCredential(httpx2.Auth):
    """lightkube's exec-plugin credential, run once at a time for the whole client. lightkube's own runs
    the plugin in every request that has no token yet or is refused (401), so a reconcile's concurrent
    requests would start it many times at start and again at each expiry (every 15 min on EKS)."""

    def __init__(self, user: User, server: str) -> None:
        self._user, self._server = user, server
        self._lock = asyncio.Lock()
        self._header: str | None = None

    async def _renewed(self, refused: str | None) -> str:
        async with self._lock:
            if self._header is None or self._header == refused:  # no other request renewed it meanwhile
                self._header = await authorization_header(self._user, self._server) or ""
            return self._header

    async def async_auth_flow(self, request: httpx2.Request) -> AsyncGenerator[httpx2.Request, httpx2.Response]:
        header = self._header or await self._renewed(None)
        request.headers["Authorization"] = header
        response = yield request
        if response.status_code == 401:  # one fresh try; a token that stays refused is the caller's 401
            request.headers["Authorization"] = await self._renewed(header)
            yield request


class LightKube:
    """The real client: lightkube's async client, one connection pool, plain dicts in and out."""

    def __init__(self, cluster: ClusterConfig, timeout: float = 30.0, concurrency: int = 16) -> None:
        # The semaphore queues requests here beyond `concurrency` instead of letting hundreds of
        # concurrent reconciles time out waiting for a pooled connection.
        self._limit = asyncio.Semaphore(concurrency)
        self.server = cluster.server
        self._client = AsyncClient(cluster.config, timeout=httpx2.Timeout(timeout))
        user = cluster.config.user
        if user is not None and user.exec is not None:
            # lightkube has no option for this: its httpx2 client is two levels down; `auth` is public.
            http = self._client._client._client
            assert isinstance(http, httpx2.AsyncClient), type(http)
            http.auth = _SharedExecCredential(user, cluster.server)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _call(self, what: str, request: Callable[[], Awaitable[T]]) -> T:
        try:
            async with self._limit:
                return await request()
        except httpx2.HTTPStatusError as err:
            raise _http_error(err) from err
        except (httpx2.HTTPError, RuntimeError) as err:  # RuntimeError: client closed at shutdown
            raise ApiError(0, type(err).__name__, f"{what}: {err!r}") from err
        except (ConfigError, OSError, ValueError, KeyError) as err:
            # Raised by the credential step before anything is sent: lightkube's ConfigError for an exec
            # plugin that exited non-zero or a token file that is gone, OSError for a plugin that cannot
            # be started, ValueError/KeyError for one that printed no ExecCredential with a token.
            raise CredentialsError(f"{what}: {type(err).__name__}: {err}") from err

    async def apply(self, manifest: Manifest, field_manager: str) -> Manifest:
        meta = manifest["metadata"]
        res = _resource(manifest["apiVersion"], manifest["kind"])
        applied = await self._call(
            f"apply {manifest['kind']} {meta['namespace']}/{meta['name']}",
            lambda: self._client.patch(
                res,
                meta["name"],
                manifest,
                namespace=meta["namespace"],
                patch_type=PatchType.APPLY,
                field_manager=field_manager,
                force=True,
            ),
        )
        return dict(applied)

    async def list(self, api_version: str, kind: str, namespace: str, labels: Mapping[str, str]) -> list[Manifest]:
        res = _resource(api_version, kind)

        async def collect() -> list[Manifest]:
            listing = self._client.list(res, namespace=namespace or _ALL_NAMESPACES, labels=dict(labels))
            return [dict(item) async for item in listing]

        items = await self._call(f"list {kind} in {namespace or 'all namespaces'}", collect)
        for item in items:  # list items omit these; builders and callers expect whole objects
            item.setdefault("apiVersion", api_version)
            item.setdefault("kind", kind)
        return items

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> Manifest | None:
        res = _resource(api_version, kind)
        try:
            found = await self._call(
                f"get {kind} {namespace}/{name}", lambda: self._client.get(res, name, namespace=namespace)
            )
        except ApiError as err:
            if err.status == 404:
                return None
            raise
        return dict(found)

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        res = _resource(api_version, kind)
        try:
            await self._call(
                f"delete {kind} {namespace}/{name}",
                lambda: self._client.delete(res, name, namespace=namespace, cascade=CascadeType.BACKGROUND),
            )
        except ApiError as err:
            if err.status != 404:
                raise

    async def patch_status(
        self, api_version: str, kind: str, namespace: str, name: str, status: Mapping[str, Any]
    ) -> Manifest:
        res = _resource(api_version, kind).Status
        patched = await self._call(
            f"patch {kind} {namespace}/{name} status",
            lambda: self._client.patch(
                res, name, {"status": dict(status)}, namespace=namespace, patch_type=PatchType.MERGE
            ),
        )
        return dict(patched)

    async def scale(
        self, api_version: str, kind: str, namespace: str, name: str, replicas: int, field_manager: str
    ) -> Manifest:
        """Set replicas through the scale subresource (as `kubectl scale` and HPAs do)."""
        res = _resource(api_version, kind).Scale
        scaled = await self._call(
            f"scale {kind} {namespace}/{name}",
            lambda: self._client.patch(
                res,
                name,
                {"spec": {"replicas": replicas}},
                namespace=namespace,
                patch_type=PatchType.MERGE,
                field_manager=field_manager,
            ),
        )
        return scaled.to_dict()

    async def create(self, manifest: Manifest) -> Manifest:
        meta = manifest["metadata"]
        res = _resource(manifest["apiVersion"], manifest["kind"])
        created = await self._call(
            f"create {manifest['kind']} in {meta['namespace']}",
            lambda: self._client.create(res(**manifest)),  # its metadata.namespace says where
        )
        return dict(created)
