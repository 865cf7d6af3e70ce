"""The kubelet's probes and lifecycle handlers, for the pod runner (``kubelet.py``).

A container's ``startupProbe``, ``readinessProbe`` and ``livenessProbe`` follow the kubelet's prober
(pkg/kubelet/prober): each probe has a result that only changes after ``successThreshold`` successes or
``failureThreshold`` failures in a row; readiness starts as failure, liveness as success, startup as "not
started"; nothing is probed before ``initialDelaySeconds`` after the container started; while a startup
probe has not succeeded the other two wait (and once it has it stops); a startup or liveness probe whose
failures reach the threshold has the container killed and stops until the container is restarted. A
readiness probe with no result yet runs at once once it may (the kubelet triggers it when it writes the
status), not a period later. Each failure is an ``Unhealthy`` event.

Handlers (a probe's or a ``lifecycle.preStop`` hook's) are ``httpGet`` (the pod's IP unless ``host`` is
set; the port by number or by the container's port name; 2xx and 3xx succeed for a probe, only 2xx for a
hook), ``tcpSocket`` (a connection is success), ``exec`` (run in the container's context by the
pod runner; exit 0 is success) and, for hooks, ``sleep``. ``grpc`` probes are not emulated (they fail,
saying so).
"""

from __future__ import annotations

import http.client
import socket
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

__all__ = [
    "ContainerProbes",
    "HandlerTarget",
    "Outcome",
    "Prober",
    "run_handler",
]

#: The API's defaults for a probe's timing fields.
DEFAULTS: Final = {
    "initialDelaySeconds": 0,
    "periodSeconds": 10,
    "timeoutSeconds": 1,
    "successThreshold": 1,
    "failureThreshold": 3,
}
#: The kubelet's ``User-Agent`` for probes (its version is the test bed's Kubernetes minor).
PROBE_USER_AGENT: Final = "kube-probe/1.36"
#: How much of a failed probe's or hook's body or output an event quotes (the kubelet's limit is 10 KiB).
MAX_OUTPUT: Final = 1024

#: A handler's verdict: success, and what to say about it (the event's text on failure).
Verdict = tuple[bool, str]


@dataclass(frozen=True)
class HandlerTarget:
    """Where a container's handlers go: its pod's IP, its named ports, and how to run a command in it."""

    ip: str
    ports: Mapping[str, int]
    #: argv that runs a command in the container's context (its root filesystem, namespaces, user, env).
    exec_argv: Callable[[Sequence[str]], list[str]]
    env: Mapping[str, str]
    cwd: str | None = None


def _port(value: Any, target: HandlerTarget) -> int:
    if isinstance(value, int):
        return value
    text = str(value)
    if text.isdigit():
        return int(text)
    if text not in target.ports:
        raise ValueError(f"port {text!r} is not a named port of the container")
    return target.ports[text]


def _http(action: Mapping[str, Any], target: HandlerTarget, timeout: float, *, hook: bool) -> Verdict:
    if str(action.get("scheme") or "HTTP").upper() != "HTTP":
        return False, "HTTPS probes and hooks are not emulated by the test bed's kubelet"
    host = str(action.get("host") or target.ip)
    try:
        port = _port(action.get("port"), target)
    except ValueError as exc:
        return False, str(exc)
    path = str(action.get("path") or "/")
    if not path.startswith("/"):
        path = "/" + path
    url = f"http://{host}:{port}{path}"
    headers = {"User-Agent": PROBE_USER_AGENT, "Accept": "*/*"}
    headers.update({h["name"]: h["value"] for h in action.get("httpHeaders") or []})
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", path, headers=headers)
        response = conn.getresponse()
        body = response.read(MAX_OUTPUT).decode(errors="replace")
    except TimeoutError:
        return False, f'Get "{url}": context deadline exceeded (Client.Timeout exceeded while awaiting headers)'
    except OSError as exc:
        return False, f'Get "{url}": {_dial_error(host, port, exc)}'
    finally:
        conn.close()
    code = response.status
    if 200 <= code < 300 or (not hook and 300 <= code < 400):
        return True, ""
    if hook:
        return False, f"HTTP lifecycle hook ({path}) failed with statuscode: {code}, body: {body!r}"
    return False, f"HTTP probe failed with statuscode: {code}"


def _dial_error(host: str, port: int, exc: OSError) -> str:
    """Go's words for a failed connection, as the kubelet's messages quote them."""
    if isinstance(exc, ConnectionRefusedError):
        return f"dial tcp {host}:{port}: connect: connection refused"
    return f"dial tcp {host}:{port}: {exc}"


def _tcp(action: Mapping[str, Any], target: HandlerTarget, timeout: float) -> Verdict:
    host = str(action.get("host") or target.ip)
    try:
        port = _port(action.get("port"), target)
    except ValueError as exc:
        return False, str(exc)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True, ""
    except TimeoutError:
        return False, f"dial tcp {host}:{port}: i/o timeout"
    except OSError as exc:
        return False, _dial_error(host, port, exc)


def _exec(action: Mapping[str, Any], target: HandlerTarget, timeout: float) -> Verdict:
    command = [str(a) for a in action.get("command") or []]
    if not command:
        return False, "exec handler has no command"
    try:
        done = subprocess.run(
            target.exec_argv(command),
            env=dict(target.env),
            cwd=target.cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return False, f"command {command!r} timed out"
    output = done.stdout[-MAX_OUTPUT:].decode(errors="replace")
    if done.returncode == 0:
        return True, output
    return False, output or f"command {command!r} exited with {done.returncode}"


def run_handler(
    handler: Mapping[str, Any],
    target: HandlerTarget,
    timeout: float,
    *,
    hook: bool = False,
    stop: threading.Event | None = None,
) -> Verdict:
    """Run one probe or hook handler against the container; ``timeout`` bounds it (for ``sleep``, ``stop``
    cuts it short: the runner is shutting down)."""
    if "httpGet" in handler:
        return _http(handler["httpGet"], target, timeout, hook=hook)
    if "tcpSocket" in handler:
        return _tcp(handler["tcpSocket"], target, timeout)
    if "exec" in handler:
        return _exec(handler["exec"], target, timeout)
    if "sleep" in handler and hook:
        seconds = min(float(handler["sleep"].get("seconds", 0)), timeout)
        (stop or threading.Event()).wait(seconds)
        return True, ""
    kinds = sorted(set(handler) - set(DEFAULTS) - {"terminationGracePeriodSeconds"})
    return False, f"handler {kinds} is not emulated by the test bed's kubelet"


@dataclass(eq=False)
class Prober:
    """One probe of one run of a container: its spec, its current result and the run of equal results
    that may flip it (the kubelet's probe worker)."""

    kind: str  # "Startup", "Readiness" or "Liveness": the events' words
    spec: Mapping[str, Any]
    started: float  # when the container started (monotonic seconds)
    result: bool
    last: bool | None = None
    run: int = 0
    #: A startup or liveness probe that failed: stopped until the container is restarted (a new Prober).
    on_hold: bool = False
    next_at: float = 0.0

    def setting(self, name: str) -> float:
        return float(self.spec.get(name) or DEFAULTS[name])

    @property
    def period(self) -> float:
        return self.setting("periodSeconds")

    @property
    def timeout(self) -> float:
        return self.setting("timeoutSeconds")

    def due(self, now: float) -> bool:
        return not self.on_hold and now >= max(self.next_at, self.started + self.setting("initialDelaySeconds"))

    def observe(self, ok: bool, now: float) -> bool:
        """Count one probe's outcome; True when the result flipped, or (startup, liveness) failed for good."""
        self.next_at = now + self.period
        if ok == self.last:
            self.run += 1
        else:
            self.last, self.run = ok, 1
        threshold = self.setting("successThreshold" if ok else "failureThreshold")
        if self.run < threshold:
            return False
        if not ok and self.kind in ("Startup", "Liveness"):
            # A startup probe's result was "unknown" until now: its failure is news even though not a flip.
            self.result, self.on_hold, self.run = False, True, 0
            return True
        if ok == self.result:
            return False
        self.result = ok
        return True


@dataclass(frozen=True)
class Outcome:
    """What one probe's result means for the container: its status changed, and/or it must be killed."""

    changed: bool = False
    kill: bool = False


@dataclass(eq=False)
class ContainerProbes:
    """The probes of one run of a container (a restart makes new ones), from its spec."""

    startup: Prober | None
    readiness: Prober | None
    liveness: Prober | None
    pending: dict[str, Any] = field(default_factory=dict)  # kind → the probe under way (a Future)

    @classmethod
    def of(cls, container: Mapping[str, Any], started: float) -> ContainerProbes:
        def make(key: str, kind: str, initial: bool) -> Prober | None:
            spec = container.get(key)
            return Prober(kind, spec, started, initial, next_at=started) if spec else None

        return cls(
            make("startupProbe", "Startup", False),
            make("readinessProbe", "Readiness", False),
            make("livenessProbe", "Liveness", True),
        )

    def get(self, kind: str) -> Prober:
        return next(p for p in (self.startup, self.readiness, self.liveness) if p is not None and p.kind == kind)

    @property
    def started(self) -> bool:
        """The container's ``started``: its startup probe has succeeded (or it has none)."""
        return self.startup is None or self.startup.result

    @property
    def ready(self) -> bool:
        """The container's ``ready``: started, and its readiness probe succeeds (or it has none)."""
        return self.started and (self.readiness is None or self.readiness.result)

    def due(self, now: float) -> list[Prober]:
        """The probes to run now (none of them already under way)."""
        candidates = [self.readiness, self.liveness] if self.started else [self.startup]
        return [p for p in candidates if p is not None and p.kind not in self.pending and p.due(now)]

    def record(self, prober: Prober, ok: bool, now: float) -> Outcome:
        """One probe's outcome, counted; what it changes."""
        was_started, was_ready = self.started, self.ready
        flipped = prober.observe(ok, now)
        if prober is self.startup and flipped and ok and self.readiness is not None and not self.readiness.result:
            # The kubelet asks for a readiness probe as soon as it writes the now-started status.
            self.readiness.next_at = now
        kill = flipped and not ok and prober.kind in ("Startup", "Liveness")
        return Outcome(changed=(self.started, self.ready) != (was_started, was_ready), kill=kill)
