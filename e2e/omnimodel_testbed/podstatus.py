"""What the pod runner writes to a pod's status, as the kubelet writes it (pure, apart from reading
the termination message).

Container states are the API's (``waiting``/``running``/``terminated``); the pod conditions follow
from them: ``Initialized`` once every init container has completed, ``ContainersReady``/``Ready`` while
every container is ready, ``PodCompleted`` as the reason once the pod has finished. A condition keeps
its ``lastTransitionTime`` until its status flips.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

__all__ = [
    "TERMINAL_PHASES",
    "container_status",
    "log_tail",
    "now",
    "pod_status",
    "running",
    "terminated",
    "termination_message",
    "waiting",
]

JSON = dict[str, Any]

TERMINAL_PHASES: Final = ("Succeeded", "Failed")
#: The kubelet's limits: a termination-log file is read up to 4 KiB; a log fallback is its last 80
#: lines, at most 2 KiB.
MAX_MESSAGE_BYTES: Final = 4096
FALLBACK_LINES: Final = 80
FALLBACK_BYTES: Final = 2048

#: The condition types the kubelet owns (PodScheduled, DisruptionTarget, ... are other components').
_OWN = ("PodReadyToStartContainers", "Initialized", "ContainersReady", "Ready")


def now() -> str:
    """The API's timestamp format (RFC 3339, seconds, UTC)."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def waiting(reason: str, message: str = "") -> JSON:
    return {"waiting": {"reason": reason, **({"message": message} if message else {})}}


def running(started_at: str) -> JSON:
    return {"running": {"startedAt": started_at}}


def terminated(exit_code: int, message: str, started_at: str, finished_at: str) -> JSON:
    """A finished container: reason Completed on exit 0, Error otherwise (a signal is 128 + its number)."""
    state: JSON = {
        "exitCode": exit_code,
        "reason": "Completed" if exit_code == 0 else "Error",
        "startedAt": started_at,
        "finishedAt": finished_at,
    }
    if message:
        state["message"] = message
    return {"terminated": state}


def container_status(
    container: Mapping[str, Any],
    state: JSON,
    *,
    ready: bool = False,
    started: bool = True,
    restart_count: int = 0,
    last_state: JSON | None = None,
) -> JSON:
    """One container's status; ``started`` (its startup probe has succeeded, or it has none) counts only
    while it runs."""
    return {
        "name": container["name"],
        "image": container.get("image", ""),
        # The pod runner sets it once the image is pulled (kubelet._write_status).
        "imageID": "",
        "ready": ready,
        "started": "running" in state and started,
        "restartCount": restart_count,
        "state": state,
        "lastState": last_state or {},
    }


def log_tail(log_path: Path, offset: int = 0) -> str:
    """The kubelet's ``FallbackToLogsOnError`` message: the last 80 lines of the container's log since
    ``offset`` (where this run of it began), at most the last 2 KiB."""
    try:
        with log_path.open("rb") as f:
            size = f.seek(0, 2)
            f.seek(max(offset, size - FALLBACK_BYTES))
            data = f.read()
    except FileNotFoundError:
        return ""
    lines = data.decode(errors="replace").splitlines(keepends=True)
    return "".join(lines[-FALLBACK_LINES:])


def termination_message(
    container: Mapping[str, Any], message_file: Path, log_path: Path, log_offset: int, exit_code: int
) -> str:
    """What the kubelet puts in ``state.terminated.message``: the termination-log file, or with
    ``terminationMessagePolicy: FallbackToLogsOnError`` the log's tail when the container failed
    and left the file empty."""
    try:
        with message_file.open("rb") as f:
            message = f.read(MAX_MESSAGE_BYTES).decode(errors="replace")
    except FileNotFoundError:
        message = ""
    if not message and exit_code != 0 and container.get("terminationMessagePolicy") == "FallbackToLogsOnError":
        message = log_tail(log_path, log_offset)
    return message


def _condition(type_: str, ok: bool, reason: str, message: str, previous: Mapping[str, JSON], at: str) -> JSON:
    status = "True" if ok else "False"
    before = previous.get(type_)
    since = before["lastTransitionTime"] if before and before.get("status") == status else at
    cond: JSON = {"type": type_, "status": status, "lastTransitionTime": since}
    if not ok and reason:
        cond["reason"] = reason
        if message:
            cond["message"] = message
    return cond


def pod_status(
    spec: Mapping[str, Any],
    phase: str,
    init_statuses: Sequence[JSON],
    statuses: Sequence[JSON],
    *,
    start_time: str,
    previous_conditions: Sequence[JSON] = (),
    at: str | None = None,
) -> JSON:
    """The ``status`` a strategic merge patch sets: phase, the kubelet's conditions (merged by type, so
    PodScheduled stays), container statuses (replaced whole)."""
    at = at or now()
    previous = {c["type"]: c for c in previous_conditions}
    done = phase in TERMINAL_PHASES
    # Complete: exited 0, or (a sidecar, restartPolicy Always) started and ready.
    incomplete = [
        s["name"] for s in init_statuses if not s["ready"] and (s["state"].get("terminated") or {}).get("exitCode") != 0
    ]
    unready = [s["name"] for s in statuses if not s["ready"]]
    not_ready_reason = "PodCompleted" if done else "ContainersNotReady"
    not_ready = f"containers with unready status: [{' '.join(unready)}]"
    conditions = [
        _condition("PodReadyToStartContainers", not done, "", "", previous, at),
        _condition(
            "Initialized",
            not incomplete,
            "PodCompleted" if done else "ContainersNotInitialized",
            f"containers with incomplete status: [{' '.join(incomplete)}]",
            previous,
            at,
        ),
        _condition("ContainersReady", not unready, not_ready_reason, not_ready, previous, at),
        _condition("Ready", not unready, not_ready_reason, not_ready, previous, at),
        # kwok reported readiness gates True; so does the runner (nothing here sets them otherwise).
        *(
            _condition(g["conditionType"], True, "", "", previous, at)
            for g in spec.get("readinessGates") or []
            if g["conditionType"] not in _OWN
        ),
    ]
    status: JSON = {
        "phase": phase,
        "startTime": start_time,
        "conditions": conditions,
        "containerStatuses": list(statuses),
    }
    if init_statuses:
        status["initContainerStatuses"] = list(init_statuses)
    return status
