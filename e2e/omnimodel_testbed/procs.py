"""Start, watch and stop background processes by PID.

Processes are started in their own session (``start_new_session``) so they
outlive the ``up`` command that launched them and can be stopped later from a
different process using only what ``state.json`` recorded. A PID alone is
not an identity (PIDs are reused), so each record also keeps the kernel's
start time of the process (``/proc/<pid>/stat`` field 22) and the executable
path; ``stop`` refuses to signal a PID whose identity no longer matches.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

__all__ = [
    "ProcessRecord",
    "ReadinessTimeoutError",
    "apoll",
    "free_port",
    "free_ports",
    "is_alive",
    "log_tail",
    "poll",
    "record",
    "setup_env",
    "start",
    "stop",
    "terminate",
    "wait_until",
]

T = TypeVar("T")

# Popen objects of children started by *this* interpreter, so they can be
# reaped (otherwise they linger as zombies until we exit).
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


class ReadinessTimeoutError(RuntimeError):
    """A readiness gate did not open before its deadline."""


@dataclass(frozen=True)
class ProcessRecord:
    """Identity of one started component, persisted in state.json."""

    name: str
    pid: int
    start_ticks: int
    exe: str
    log: str

    def to_json(self) -> dict[str, Any]:
        """Plain dict for json.dump."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ProcessRecord:
        """Inverse of :meth:`to_json`."""
        return cls(
            name=str(data["name"]),
            pid=int(data["pid"]),
            start_ticks=int(data["start_ticks"]),
            exe=str(data["exe"]),
            log=str(data["log"]),
        )


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) of ``pid``, or None if gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # comm (field 2) may contain spaces/parens; everything after the last ')' is fixed-format.
    rest = raw[raw.rindex(")") + 2 :].split()
    return rest[0], int(rest[19])


def is_alive(rec: ProcessRecord) -> bool:
    """True if ``rec.pid`` is still the process we started and not a zombie."""
    child = _CHILDREN.get(rec.pid)
    if child is not None and child.poll() is not None:
        return False
    st = _stat(rec.pid)
    if st is None:
        return False
    state, ticks = st
    return ticks == rec.start_ticks and state not in ("Z", "X")


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports on 127.0.0.1 that were free a moment ago.

    All sockets are held open together so the kernel cannot hand the same
    port out twice; the small race with other processes after close is
    acceptable for a test bed (a clash shows up as a failed readiness gate).
    """
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    """One TCP port on 127.0.0.1 that was free a moment ago."""
    return free_ports(1)[0]


def start(
    name: str,
    argv: Sequence[str],
    log: Path,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> ProcessRecord:
    """Start ``argv`` detached (own session), stdout+stderr appended to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as fh:
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            start_new_session=True,
        )
    _CHILDREN[proc.pid] = proc
    st = _stat(proc.pid)
    if st is None:
        proc.wait()
        raise RuntimeError(f"{name} exited immediately (code {proc.returncode}); see {log}")
    return ProcessRecord(name=name, pid=proc.pid, start_ticks=st[1], exe=str(argv[0]), log=str(log))


def record(name: str, pid: int, log: str | Path, exe: str = "") -> ProcessRecord:
    """Identity of a running process started elsewhere (e.g. a pod's), so another process can stop it
    later with :func:`stop`; raises RuntimeError when ``pid`` is already gone."""
    st = _stat(pid)
    if st is None:
        raise RuntimeError(f"{name} (pid {pid}) is not running")
    return ProcessRecord(name=name, pid=pid, start_ticks=st[1], exe=exe, log=str(log))


def _signal_group(rec: ProcessRecord, sig: signal.Signals) -> None:
    # The process is a session (and group) leader, so signal the whole group:
    # that also catches any helper it may have forked.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(rec.pid, sig)


def stop(records: Sequence[ProcessRecord], *, grace: float = 10.0) -> list[ProcessRecord]:
    """Stop processes in the given order: SIGTERM, then SIGKILL after ``grace`` s.

    Returns the records that were alive (and therefore signalled). Records
    whose PID now belongs to someone else are skipped, never signalled.
    """
    signalled: list[ProcessRecord] = []
    for rec in records:
        if not is_alive(rec):
            child = _CHILDREN.get(rec.pid)
            if child is not None and child.poll() is not None:
                _reap(rec.pid)
            continue
        signalled.append(rec)
        _signal_group(rec, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while is_alive(rec) and time.monotonic() < deadline:
            time.sleep(0.05)
        if is_alive(rec):
            _signal_group(rec, signal.SIGKILL)
            kill_deadline = time.monotonic() + 5.0
            while is_alive(rec) and time.monotonic() < kill_deadline:
                time.sleep(0.05)
        _reap(rec.pid)
    return signalled


def terminate(proc: subprocess.Popen[Any], *, grace: float) -> int:
    """Stop our own child ``proc``: SIGTERM, then SIGKILL if it has not exited after ``grace`` s; returns its
    exit code (at once when it had already exited)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    return proc.returncode


def _reap(pid: int) -> None:
    """Collect the exit status of our own child ``pid`` once it has exited.

    A child that is still running stays registered: the PID may belong to a
    record that was *not* stopped (e.g. a stale record whose identity check
    failed while the real child lives on).
    """
    child = _CHILDREN.get(pid)
    if child is None:
        return
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(timeout=1.0)
    if child.returncode is not None:
        del _CHILDREN[pid]


def setup_env(script: Path, needs: str, error: type[Exception]) -> Path:
    """Run the environment-building ``script`` (its log goes to our stderr) and return the directory it
    prints last; raise ``error`` when it fails or that directory has no ``needs`` (a path inside it)."""
    proc = subprocess.run(["bash", str(script)], stdout=subprocess.PIPE, stderr=sys.stderr, text=True, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    if proc.returncode != 0 or not lines:
        raise error(f"{script} failed with exit code {proc.returncode}")
    env = Path(lines[-1])
    if not (env / needs).exists():
        raise error(f"{env} has no {needs}")
    return env


def log_tail(path: str | Path, lines: int = 30) -> str:
    """Last ``lines`` lines of a log file, for error messages."""
    try:
        with Path(path).open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 16384))
            data = fh.read().decode(errors="replace")
    except FileNotFoundError:
        return "<no log>"
    return "\n".join(data.splitlines()[-lines:])


def wait_until(
    what: str,
    predicate: Callable[[], bool],
    *,
    timeout: float,
    interval: float = 0.1,
    watch: Sequence[ProcessRecord] = (),
) -> float:
    """Poll ``predicate`` until it is true; return seconds waited.

    Exceptions from the predicate count as "not yet" (a port that is not
    listening yet raises ConnectionRefusedError). Fails fast, with the log
    tail, if a process in ``watch`` dies meanwhile.
    """
    t0 = time.monotonic()
    deadline = t0 + timeout
    last_exc: BaseException | None = None
    while True:
        try:
            if predicate():
                return time.monotonic() - t0
        except Exception as exc:
            last_exc = exc
        for rec in watch:
            if not is_alive(rec):
                raise ReadinessTimeoutError(
                    f"{rec.name} (pid {rec.pid}) exited while waiting for {what}; log {rec.log}:\n{log_tail(rec.log)}"
                )
        if time.monotonic() >= deadline:
            detail = f" (last error: {last_exc!r})" if last_exc else ""
            logs = "".join(f"\n--- {r.name} ({r.log}) ---\n{log_tail(r.log)}" for r in watch)
            raise ReadinessTimeoutError(f"timed out after {timeout:.0f}s waiting for {what}{detail}{logs}")
        time.sleep(interval)


def poll(
    predicate: Callable[[], T | None],
    *,
    timeout: float,
    what: str,
    interval: float = 0.1,
    error: type[Exception] = AssertionError,
) -> T:
    """Call ``predicate`` every ``interval`` s until it returns something truthy, and return that; after
    ``timeout`` s raise ``error`` naming ``what`` and the last value. Exceptions from ``predicate`` are
    not caught (a check that fails fails at once); :func:`wait_until` is the readiness gate that retries them.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise error(f"timed out after {timeout:.0f}s waiting for {what}; last value: {value!r}")
        time.sleep(interval)


async def apoll(
    predicate: Callable[[], Any],
    *,
    # The same keywords as poll(): the deadline also names what never came, which asyncio.timeout cannot.
    timeout: float,  # noqa: ASYNC109
    what: str,
    interval: float = 0.01,
) -> Any:
    """:func:`poll` for a test running on an event loop: ``predicate`` (plain or a coroutine function) is
    checked every ``interval`` s while the loop runs the code under test; after ``timeout`` s an
    AssertionError names ``what`` and the last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last value: {value!r}")
        await asyncio.sleep(interval)
