"""Before kopf starts: find the cluster config, and prove that the API server lets the operator list
OmniModels where it is going to watch them.

Left to kopf, a missing config fails the startup handler that builds our client, which kopf retries
every minute, forever, never serving ``/healthz``: probe kills, with the reason only in the logs. Refused
credentials end, after seconds (401) or a minute (403), in a kopf traceback that blames a missing client
library rather than the credentials. This check turns each into one error line and exit status 1:

* no cluster config, or one that cannot be read: at once, naming every place that was looked at;
* credentials refused (401) or not allowed to list OmniModels (403), or a server certificate that
  fails verification: at once, in the API server's (or the TLS library's) words;
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
from pathlib import Path

from omnimodel_operator import constants as C
from omnimodel_operator.kube import _IN_CLUSTER_DIR, ApiError, Connection, HttpKube, load_connection

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


def _home_kubeconfig() -> Path:
    return Path.home() / ".kube" / "config"


def _source() -> str:
    """Which config ``load_connection`` reads, in its own order, for messages."""
    if kubeconfig := os.environ.get("KUBECONFIG"):
        return f"KUBECONFIG={kubeconfig}"
    if (_IN_CLUSTER_DIR / "token").exists():
        return f"the in-cluster service account ({_IN_CLUSTER_DIR})"
    return str(_home_kubeconfig())


def connection() -> tuple[Connection, str]:
    """The connection our own client uses (``kube.load_connection``) and where it came from."""
    token = _IN_CLUSTER_DIR / "token"
    host = os.environ.get("KUBERNETES_SERVICE_HOST")
    home = _home_kubeconfig()
    if not (os.environ.get("KUBECONFIG") or (host and token.exists()) or home.exists()):
        raise StartupError(
            "no Kubernetes cluster config: not in a cluster (KUBERNETES_SERVICE_HOST "
            f"{'set' if host else 'unset'}, {token} {'present' if token.exists() else 'absent'}), "
            f"KUBECONFIG unset, {home} absent"
        )
    source = _source()
    try:
        return load_connection(), source
    except Exception as err:
        # Any failure here is final (a missing file, bad YAML, no current context, a bad CA...).
        raise StartupError(
            f"cannot read the cluster config from {source}: {type(err).__name__}: {_words(err)}"
        ) from err


def _scopes(namespaces: Sequence[str]) -> list[str]:
    """Where to list OmniModels: cluster-wide ("") or each plain namespace the operator watches."""
    if not namespaces:
        return [""]
    return [ns for ns in namespaces if _NAMESPACE.fullmatch(ns)]


def _certificate_failure(err: BaseException) -> ssl.SSLCertVerificationError | None:
    """The certificate check under an httpx connect error, if that is what failed (retrying cannot fix
    it; other TLS errors, such as a handshake cut short by a starting server, are retried)."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _refusal(err: ApiError, conn: Connection, source: str, where: str) -> StartupError | None:
    """A ``StartupError`` when ``err`` is final, ``None`` when waiting may help."""
    listing = f"listing {C.PLURAL}.{C.GROUP} {where}"
    if err.status in (401, 403):
        return StartupError(
            f"the API server at {conn.server} refused the credentials from {source} ({listing}): {_words(err)}"
        )
    if bad_cert := _certificate_failure(err):
        return StartupError(
            f"the API server at {conn.server} failed the TLS check (config from {source}): {_words(bad_cert)}"
        )
    if err.transient or err.status == 404:
        return None
    return StartupError(f"the API server at {conn.server} rejected {listing}: {_words(err)}")


@dataclass
class _Waiting:
    """What the last attempt saw, for the message when the wait runs out."""

    where: str = "cluster-wide"
    last: str = "no answer yet"
    warned: bool = False


async def _list_omnimodels(
    client: HttpKube, conn: Connection, source: str, scopes: Sequence[str], waiting: _Waiting
) -> None:
    """List OmniModels in each scope, retrying what waiting may fix (no deadline of its own)."""
    for scope in scopes:
        waiting.where = f"in namespace {scope}" if scope else "cluster-wide"
        delay = 0.5
        while True:
            try:
                await client.list(C.API_VERSION, C.KIND, scope, {})
                break
            except ApiError as err:
                if (refused := _refusal(err, conn, source, waiting.where)) is not None:
                    raise refused from err
                waiting.last = _words(err) + (f" (is the {C.CRD_NAME} CRD installed?)" if err.status == 404 else "")
            if not waiting.warned:  # once: an API server still starting beside the operator is normal
                logger.warning(f"API server at {conn.server} not ready yet ({waiting.last}); retrying")
                waiting.warned = True
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
        logger.info(f"Listed {C.PLURAL}.{C.GROUP} {waiting.where} at {conn.server} (config from {source})")


def preflight(namespaces: Sequence[str], timeout: float) -> None:
    """Raise ``StartupError`` unless the operator has a cluster config whose credentials can list
    OmniModels where it watches them, retrying an API server that is not up yet for ``timeout`` s."""
    conn, source = connection()
    waiting = _Waiting()

    async def bounded() -> None:
        client = HttpKube(conn)
        try:
            async with asyncio.timeout(timeout):
                await _list_omnimodels(client, conn, source, _scopes(namespaces), waiting)
        except TimeoutError:
            raise StartupError(
                f"the API server at {conn.server} could not list {C.PLURAL}.{C.GROUP} {waiting.where} within "
                f"{timeout:g} s ({_TIMEOUT_ENV}): {waiting.last}"
            ) from None
        finally:
            await client.aclose()

    asyncio.run(bounded())
