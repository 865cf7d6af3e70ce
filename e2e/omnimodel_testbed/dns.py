"""A tiny cluster DNS for the test bed: ``<service>.<namespace>.svc[.cluster.local]`` → pod addresses.

Stands in for CoreDNS so that in-cluster names resolve for processes the test bed runs as pods. It
answers A queries from EndpointSlices (ready endpoints only), as CoreDNS does for headless Services.
The test bed has no kube-proxy, so a ClusterIP Service's virtual IP would lead nowhere: for those it
answers with the endpoints too (the one deliberate difference from a real cluster). Every other
name gets NXDOMAIN at once, so nothing waits on an upstream resolver that does not exist here.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import struct
import threading
import time
import urllib.parse
from collections.abc import Callable

from .kubeapi import KubeAPI

__all__ = ["ClusterDNS", "parse_query", "service_addresses"]

log = logging.getLogger("omnimodel_testbed")

_TYPE_A = 1
_CLASS_IN = 1
_NXDOMAIN = 3
_TTL = 1


def parse_query(packet: bytes) -> tuple[int, int, str, int, int]:
    """(id, flags, name, qtype, end of question) of a one-question DNS query."""
    ident, flags, qdcount = struct.unpack("!HHH", packet[:6])
    if qdcount != 1:
        raise ValueError("expected exactly one question")
    labels, pos = [], 12
    while (length := packet[pos]) != 0:
        labels.append(packet[pos + 1 : pos + 1 + length].decode("ascii").lower())
        pos += 1 + length
    qtype, _qclass = struct.unpack("!HH", packet[pos + 1 : pos + 5])
    return ident, flags, ".".join(labels), qtype, pos + 5


def answer(packet: bytes, addresses: list[str] | None) -> bytes:
    """A response to ``packet``: A records for ``addresses``, or NXDOMAIN when it is None."""
    ident, flags, _name, qtype, end = parse_query(packet)
    rd = flags & 0x0100
    records = [a for a in addresses or [] if ipaddress.ip_address(a).version == 4] if qtype == _TYPE_A else []
    rcode = _NXDOMAIN if addresses is None else 0
    header = struct.pack("!HHHHHH", ident, 0x8400 | rd | rcode, 1, len(records), 0, 0)
    body = packet[12:end]
    for addr in records:
        # name as a pointer to the question (offset 12), type A, class IN, TTL, 4 bytes of address
        body += struct.pack("!HHHIH", 0xC00C, _TYPE_A, _CLASS_IN, _TTL, 4) + socket.inet_aton(addr)
    return header + body


def service_addresses(api: KubeAPI, namespace: str, service: str) -> list[str] | None:
    """Ready endpoint addresses of a Service, or None when it does not exist."""
    status, _ = api.raw("GET", f"/api/v1/namespaces/{namespace}/services/{service}")
    if status == 404:
        return None
    if (namespace, service) == ("default", "kubernetes"):
        # The API server's own address, which its endpoint reconciler would publish (it is off: an
        # EndpointSlice may not hold a loopback address).
        return ["127.0.0.1"]
    selector = urllib.parse.quote(f"kubernetes.io/service-name={service}")
    slices = api.get(f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices?labelSelector={selector}")
    out: list[str] = []
    for item in slices.get("items", []):
        for endpoint in item.get("endpoints") or []:
            if (endpoint.get("conditions") or {}).get("ready") is False:
                continue
            out.extend(endpoint.get("addresses") or [])
    return sorted(set(out))


class ClusterDNS:
    """UDP DNS server on ``host:port`` answering cluster names; stop() ends its thread."""

    def __init__(
        self,
        lookup: Callable[[str, str], list[str] | None],
        host: str = "127.0.0.53",
        port: int = 53,
        cache_seconds: float = 0.5,
    ) -> None:
        self._lookup = lookup
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind((host, port))
        self._sock.settimeout(0.2)
        self.address = self._sock.getsockname()
        self._cache: dict[tuple[str, str], tuple[float, list[str] | None]] = {}
        self._cache_seconds = cache_seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="testbed-dns", daemon=True)
        self._thread.start()

    def resolve(self, name: str) -> list[str] | None:
        parts = name.removesuffix(".cluster.local").split(".")
        if len(parts) != 3 or parts[2] != "svc":
            return None
        key = (parts[1], parts[0])
        now = time.monotonic()
        cached = self._cache.get(key)
        if cached is not None and now - cached[0] < self._cache_seconds:
            return cached[1]
        try:
            result = self._lookup(*key)
        except OSError as err:
            # Serve the last answer rather than none (CoreDNS's serve_stale): the lookup is an API read
            # from a busy process, and under CI's load its TLS handshake timed out; a failed answer then
            # broke every client of a Service whose endpoints had not changed (Mooncake's master, the head).
            log.warning("DNS lookup of %s failed (%s); %s", name, err, "the last answer" if cached else "no answer")
            return cached[1] if cached else None
        self._cache[key] = (now, result)
        return result

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                packet, peer = self._sock.recvfrom(512)
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                _, _, name, _, _ = parse_query(packet)
                self._sock.sendto(answer(packet, self.resolve(name)), peer)
            except (ValueError, IndexError, struct.error) as err:
                log.debug("Ignored a malformed DNS packet: %s", err)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()
