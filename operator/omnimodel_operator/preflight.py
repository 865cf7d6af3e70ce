"""Before kopf starts: find the cluster config, and prove that the API server lets the operator list
OmniModels where it is going to watch them.

Left to kopf, a missing config fails the startup handler that builds our client, which kopf retries
every minute, forever, never serving ``/healthz``: probe kills, with the reason only in the logs. Refused
credentials end, after seconds (401) or a minute (403), in a kopf traceback that blames a missing client
library rather than the credentials. This check turns each into one error line and exit status 1:

* no cluster config, or one that cannot be read or used (an ``auth-provider`` user): at once, naming
  every place that was looked at;
* credentials refused (401) or not allowed to list OmniModels (403), credentials that cannot be had (an
  exec plugin that fails), or a server certificate that fails verification: at once, in the API
  server's (or the plugin's, or the TLS library's) words;
* the API server unreachable, answering 5xx/429, or not serving OmniModels yet (404: the CRD is not
  established): retried for ``OperatorSettings.api_startup_timeout`` seconds, then the last error.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import ssl
from collections.abc import Sequence
from dataclasses import dataclass

from omnimodel_operator import constants as C
from omnimodel_operator.kube import (
    _IN_CLUSTER_DIR,
    ApiError,
    ClusterConfig,
    CredentialsError,
    LightKube,
    config_source,
    home_kubeconfig,
    load_config,
)

logger = logging.getLogger(__name__)

# A plain namespace name (DNS-1123 label); anything else in OMNIMODEL_NAMESPACES is a kopf pattern
# (`team-*`, `!kube-system`), resolved by kopf itself later.
_NAMESPACE: re.Pattern[str] = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_TIMEOUT_ENV = "OMNIMODEL_API_STARTUP_TIMEOUT"


class StartupError(Exception):
    """The operator cannot start; the message says why, on one line."""


def _words(err: BaseException) -> str:
    """An error on one line (a plain-text 404 body ends in a newline, YAML errors span several)."""
    return " ".join(str(err).split())


def cluster_config() -> ClusterConfig:
    """The cluster config our own client uses (``kube.load_config``), or a ``StartupError`` saying why not."""
    token = _IN_CLUSTER_DIR / "token"
    host = os.environ.get("KUBERNETES_SERVICE_HOST")
    home = home_kubeconfig()
    if not (os.environ.get("KUBECONFIG") or (host and token.exists()) or home.exists()):
        raise StartupError(
            "no Kubernetes cluster config: not in a cluster (KUBERNETES_SERVICE_HOST "
            f"{'set' if host else 'unset'}, {token} {'present' if token.exists() else 'absent'}), "
            f"KUBECONFIG unset, {home} absent"
        )
    source = config_source()
    try:
        return load_config()
    except Exception as err:
        # Any failure here is final (a missing file, bad YAML, no current context, an auth-provider...).
        raise StartupError(
            f"cannot read the cluster config from {source}: {type(err).__name__}: {_words(err)}"
        ) from err


def _scopes(namespaces: Sequence[str]) -> list[str]:
    """Where to list OmniModels: cluster-wide ("") or each plain namespace the operator watches."""
    if not namespaces:
        return [""]
    return [ns for ns in namespaces if _NAMESPACE.fullmatch(ns)]


def _certificate_failure(err: BaseException) -> ssl.SSLCertVerificationError | None:
    """The certificate check under an HTTP connect error, if that is what failed (retrying cannot fix
    it; other TLS errors, such as a handshake cut short by a starting server, are retried)."""
    visited: set[int] = set()
    seen: BaseException | None = err
    # lightkube raises an HTTP status error from itself (`raise e from e`): a chain can loop.
    while seen is not None and id(seen) not in visited:
        if isinstance(seen, ssl.SSLCertVerificationError):
            return seen
        visited.add(id(seen))
        seen = seen.__cause__ or seen.__context__
    return None


def _refusal(err: ApiError, cluster: ClusterConfig, where: str) -> StartupError | None:
    """A ``StartupError`` when ``err`` is final, ``None`` when waiting may help."""
    listing = f"listing {C.PLURAL}.{C.GROUP} {where}"
    server, source = cluster.server, cluster.source
    if err.status in (401, 403):
        return StartupError(
            f"the API server at {server} refused the credentials from {source} ({listing}): {_words(err)}"
        )
    if isinstance(err, CredentialsError):
        # A plugin that fails at start is misconfigured or missing; waiting for it hides the reason.
        return StartupError(
            f"no credentials for the API server at {server} from {source}: {' '.join(err.message.split())}"
        )
    if bad_cert := _certificate_failure(err):
        return StartupError(
            f"the API server at {server} failed the TLS check (config from {source}): {_words(bad_cert)}"
        )
    if err.transient or err.status == 404:
        return None
    return StartupError(f"the API server at {server} rejected {listing}: {_words(err)}")


@dataclass
class _Waiting:
    """What the last attempt saw, for the message when the wait runs out."""

    where: str = "cluster-wide"
    last: str = "no answer yet"
    warned: bool = False


async def _list_omnimodels(client: LightKube, cluster: ClusterConfig, scopes: Sequence[str], waiting: _Waiting) -> None:
    """List OmniModels in each scope, retrying what waiting may fix (no deadline of its own)."""
    for scope in scopes:
        waiting.where = f"in namespace {scope}" if scope else "cluster-wide"
        delay = 0.5
        while True:
            try:
                await client.list(C.API_VERSION, C.KIND, scope, {})
                break
            except ApiError as err:
                if (refused := _refusal(err, cluster, waiting.where)) is not None:
                    raise refused from err
                waiting.last = _words(err) + (f" (is the {C.CRD_NAME} CRD installed?)" if err.status == 404 else "")
            if not waiting.warned:  # once: an API server still starting beside the operator is normal
                logger.warning(f"API server at {cluster.server} not ready yet ({waiting.last}); retrying")
                waiting.warned = True
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
        logger.info(f"Listed {C.PLURAL}.{C.GROUP} {waiting.where} at {cluster.server} (config from {cluster.source})")


def preflight(namespaces: Sequence[str], timeout: float) -> None:
    """Raise ``StartupError`` unless the operator has a cluster config whose credentials can list
    OmniModels where it watches them, retrying an API server that is not up yet for ``timeout`` s."""
    cluster = cluster_config()
    waiting = _Waiting()

    async def bounded() -> None:
        client = LightKube(cluster)
        try:
            async with asyncio.timeout(timeout):
                await _list_omnimodels(client, cluster, _scopes(namespaces), waiting)
        except TimeoutError:
            raise StartupError(
                f"the API server at {cluster.server} could not list {C.PLURAL}.{C.GROUP} {waiting.where} within "
                f"{timeout:g} s ({_TIMEOUT_ENV}): {waiting.last}"
            ) from None
        finally:
            await client.aclose()

    asyncio.run(bounded())
