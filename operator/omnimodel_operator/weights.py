"""What the fetch of an ``hf://`` model's weights has done, from its Job, its pods and its progress.

Pure: the Job and its pods come from the watch-fed cache, the progress (``GET /progress`` of the
running fetch pod, see :mod:`omnimodel_operator.weights_progress`) from the last scrape. The result is
``status.weights`` and the ``WeightsReady`` condition; Ready stays False until the weights are there.

Where each field comes from:

- **Complete / Failed**: the Job's own conditions (``Complete``, ``Failed``; ``SuccessCriteriaMet`` and
  ``FailureTarget`` say the same a moment earlier), so a Job that retried and then succeeded is Complete.
- **reason and message**: the one line ``omnimodel fetch`` writes as its termination message
  (``Unauthorized: 401 ...``, ``Complete: org/name@sha: 12 files, ...``), from the newest pod that ended.
  A pod that crashed before writing it leaves its log's tail there (``FallbackToLogsOnError``).
- **bytes and files**: the running pod's ``/progress``; after completion, the ``Complete:`` line.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

from omnimodel_operator.api.v1alpha1 import WeightsStatus

Manifest = dict[str, Any]

# The reasons `omnimodel fetch` gives (omnimodel_runtime.fetch.hub.REASONS); anything else is Failed.
FETCH_REASONS: Final = frozenset(
    {"Unauthorized", "NotFound", "NoSpace", "Network", "RateLimited", "HubError", "Invalid", "Failed"}
)
_COMPLETE = re.compile(r"^Complete: (?P<repo>\S+)@(?P<sha>[0-9a-f]{40}): (?P<files>\d+) files, (?P<bytes>\d+) bytes")
# "...; stage bytes: thinker=123 talker=45" (omnimodel_runtime.fetch.run.FetchResult.message).
_STAGE_BYTES = re.compile(r"; stage bytes: (?P<pairs>(?:[A-Za-z0-9_.-]+=\d+ ?)+)$")


@dataclass(frozen=True)
class Weights:
    """``status.weights`` and the ``WeightsReady`` condition's reason and message."""

    status: WeightsStatus
    condition_reason: str
    condition_message: str

    @property
    def ready(self) -> bool:
        return self.status.state == "Complete"

    @property
    def failed(self) -> bool:
        return self.status.state == "Failed"


def known_stage_bytes(old: WeightsStatus | None, job_name: str) -> dict[str, int]:
    """Each stage's bytes as last reported for this fetch Job (the Job's name hashes what it fetches)."""
    return dict(old.stage_bytes or {}) if old is not None and old.job == job_name else {}


def keep_stage_bytes(weights: Weights, old: WeightsStatus | None) -> Weights:
    """``weights`` with the sizes its Job reported before, when this pass could not read them again (the
    fetch pod's progress is scraped only while it runs, a completed pod may be garbage-collected): the
    stages' memory requests follow them, and a size that came and went would roll the stages each time."""
    known = known_stage_bytes(old, weights.status.job)
    if weights.status.stage_bytes or not known:
        return weights
    return replace(weights, status=weights.status.model_copy(update={"stage_bytes": known}))


def _job_condition(job: Mapping[str, Any], *types: str) -> Mapping[str, Any] | None:
    for c in (job.get("status") or {}).get("conditions") or []:
        if c.get("type") in types and c.get("status") == "True":
            return dict(c)
    return None


def _terminated(pod: Mapping[str, Any]) -> Mapping[str, Any] | None:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        state = (cs.get("state") or {}).get("terminated")
        if state:
            return dict(state)
    return None


def _ended(pods: Sequence[Manifest]) -> list[tuple[str, Mapping[str, Any]]]:
    """(phase, terminated state) of pods that ended, newest first."""
    out = []
    for pod in pods:
        phase = (pod.get("status") or {}).get("phase")
        term = _terminated(pod)
        if phase in ("Succeeded", "Failed") and term is not None:
            out.append((str(phase), term))
    out.sort(key=lambda item: str(item[1].get("finishedAt") or ""), reverse=True)
    return out


def _one_line(text: str, limit: int = 600) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _stage_bytes(text: str) -> dict[str, int] | None:
    found = _STAGE_BYTES.search(text)
    if found is None:
        return None
    return {name: int(size) for name, size in (pair.split("=") for pair in found["pairs"].split())}


def _sizes(progress: Mapping[str, Any]) -> dict[str, int] | None:
    sizes = progress.get("stage_bytes")
    if not isinstance(sizes, Mapping) or not sizes:
        return None
    try:
        return {str(k): int(v) for k, v in sizes.items()}
    except (TypeError, ValueError):
        return None  # a fetch of another version: the sizes are an aid, never a reason to fail


def _reason_of(message: str) -> str:
    word = message.split(":", 1)[0].strip()
    return word if word in FETCH_REASONS else "Failed"


def _pending_reason(pods: Sequence[Manifest]) -> str:
    """Why the fetch pod has not started: unschedulable (e.g. a claim no volume can bind), a pull error."""
    for pod in pods:
        status = pod.get("status") or {}
        for c in status.get("conditions") or []:
            if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("message"):
                return _one_line(f"{c.get('reason', 'Unschedulable')}: {c['message']}")
        for cs in status.get("containerStatuses") or []:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") not in (None, "ContainerCreating", "PodInitializing"):
                return _one_line(f"{waiting['reason']}: {waiting.get('message', '')}".rstrip(": "))
    return ""


def weights_state(
    job_name: str,
    revision: str | None,
    job: Manifest | None,
    pods: Sequence[Manifest],
    progress: Mapping[str, Any] | None = None,
) -> Weights:
    """The fetch's state. ``pods`` are the Job's pods; ``progress`` the running pod's last ``/progress``."""
    revision = revision or "main"
    base: dict[str, Any] = {"job": job_name, "revision": revision}
    if job is None:
        message = f"fetch Job {job_name} not created yet"
        return Weights(WeightsStatus(state="Pending", message=message, **base), "Pending", message)
    ended = _ended(pods)
    last_message = _one_line(ended[0][1].get("message") or "") if ended else ""
    if _job_condition(job, "Complete", "SuccessCriteriaMet"):
        succeeded = next((t for phase, t in ended if phase == "Succeeded"), None)
        text = _one_line((succeeded or {}).get("message") or "")
        found = _COMPLETE.match(text)
        numbers: dict[str, Any] = {}
        if found:
            files, size = int(found["files"]), int(found["bytes"])
            numbers = {"sha": found["sha"], "files_done": files, "files_total": files,
                       "bytes_done": size, "bytes_total": size, "stage_bytes": _stage_bytes(text)}  # fmt: skip
        message = text or f"fetch Job {job_name} completed"
        return Weights(WeightsStatus(state="Complete", message=message, **base, **numbers), "Complete", message)
    failed = _job_condition(job, "Failed", "FailureTarget")
    if failed is not None:
        reason = _reason_of(last_message) if last_message else "Failed"
        why = last_message or _one_line(failed.get("message") or failed.get("reason") or "")
        message = f"{why} (fetch Job {job_name} gave up; fix the cause, then delete the Job to fetch again)"
        status = WeightsStatus(state="Failed", reason=reason, message=message, **base)
        return Weights(status, reason, message)
    running = [p for p in pods if (p.get("status") or {}).get("phase") == "Running"]
    numbers = {}
    if progress:
        numbers = {
            k: progress.get(src)
            for k, src in (("sha", "sha"), ("files_done", "files_done"), ("files_total", "files_total"),
                           ("bytes_done", "bytes_done"), ("bytes_total", "bytes_total"))
            if progress.get(src) is not None
        }  # fmt: skip
        numbers["stage_bytes"] = _sizes(progress)
    retry = f"; retrying after: {last_message}" if last_message else ""
    if running:
        if numbers.get("bytes_total"):
            done, total = int(numbers.get("bytes_done") or 0), int(numbers["bytes_total"])
            text = (f"fetching {numbers.get('files_done', 0)}/{numbers.get('files_total', 0)} files, "
                    f"{done}/{total} bytes ({100.0 * done / total:.1f}%)")  # fmt: skip
        else:
            text = f"fetch Job {job_name} is resolving {revision}"
        message = text + retry
        return Weights(WeightsStatus(state="Fetching", message=message, **base, **numbers), "Fetching", message)
    why = _pending_reason(pods)
    message = f"fetch Job {job_name} has no running pod yet" + (f": {why}" if why else "") + retry
    return Weights(WeightsStatus(state="Pending", message=message, **base), "Pending", message)
