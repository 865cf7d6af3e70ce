"""A deliberately tiny Kubernetes REST client (stdlib only).

The harness needs a handful of calls (readyz, create/list Nodes, get a
ServiceAccount, the pod runner's status patches). Using ``http.client`` keeps it typed (the ``kubernetes``
package ships no type information), free of global configuration state, and
independent of whatever kubeconfig the caller has loaded elsewhere.
"""

from __future__ import annotations

import http.client
import json
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ApiError", "KubeAPI", "http_get"]

JSON = dict[str, Any]


class ApiError(RuntimeError):
    """Non-2xx answer from the apiserver."""

    def __init__(self, method: str, path: str, status: int, body: str) -> None:
        super().__init__(f"{method} {path} -> {status}: {body[:500]}")
        self.status = status
        self.body = body


@dataclass(frozen=True)
class KubeAPI:
    """Client-certificate authenticated access to one apiserver."""

    host: str
    port: int
    ca_file: Path
    cert_file: Path
    key_file: Path
    timeout: float = 10.0

    def _context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        ctx.load_cert_chain(str(self.cert_file), str(self.key_file))
        return ctx

    def raw(
        self, method: str, path: str, body: JSON | None = None, content_type: str = "application/json"
    ) -> tuple[int, str]:
        """Send one request; return (status, body text). Raises OSError on connection failure."""
        conn = http.client.HTTPSConnection(self.host, self.port, context=self._context(), timeout=self.timeout)
        try:
            headers = {"Accept": "application/json"}
            payload: bytes | None = None
            if body is not None:
                payload = json.dumps(body).encode()
                headers["Content-Type"] = content_type
            conn.request(method, path, body=payload, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.read().decode(errors="replace")
        finally:
            conn.close()

    def request(self, method: str, path: str, body: JSON | None = None, content_type: str = "application/json") -> JSON:
        """Send one request and decode the JSON answer; raise ApiError unless 2xx."""
        status, text = self.raw(method, path, body, content_type)
        if not 200 <= status < 300:
            raise ApiError(method, path, status, text)
        result: JSON = json.loads(text) if text else {}
        return result

    def get(self, path: str) -> JSON:
        """GET ``path``."""
        return self.request("GET", path)

    def create(self, path: str, obj: JSON) -> JSON:
        """POST ``obj`` to the collection ``path``."""
        return self.request("POST", path, obj)

    def patch(self, path: str, patch: JSON, *, strategic: bool = False) -> JSON:
        """PATCH ``path``: a JSON merge patch, or a strategic merge patch (lists such as a pod's
        ``conditions`` merged by key instead of replaced)."""
        kind = "strategic-merge-patch" if strategic else "merge-patch"
        return self.request("PATCH", path, patch, content_type=f"application/{kind}+json")

    def delete(self, path: str) -> JSON:
        """DELETE ``path``."""
        return self.request("DELETE", path)


def http_get(url_host: str, port: int, path: str, *, tls: bool, timeout: float = 2.0) -> int:
    """Status of an unauthenticated GET (health endpoints); TLS is not verified.

    The controller-manager and scheduler serve /healthz with a self-signed
    certificate they generate in memory, so there is nothing to verify against.
    """
    conn: http.client.HTTPConnection
    if tls:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        conn = http.client.HTTPSConnection(url_host, port, context=ctx, timeout=timeout)
    else:
        conn = http.client.HTTPConnection(url_host, port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()
