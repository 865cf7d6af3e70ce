"""Runtime settings: one pydantic-settings object per process, from ``OMNIMODEL_*`` env and CLI flags.

The operator's Deployments set ``OMNIMODEL_MODEL_CACHE``, ``OMNIMODEL_DEVICE`` and (gateway)
``OMNIMODEL_API_KEY`` and pass ``--pipeline/--stage/--host/--port`` as flags; the CLI hands flags in
as init arguments, which take precedence over the environment.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

Device = Literal["auto", "cpu", "cuda", "xpu", "npu"]


def _default_model_cache() -> Path:
    return Path.home() / ".cache" / "omnimodel" / "models"


class StageTimeouts(BaseModel):
    """Timeouts of one stage as the gateway applies them; unset ones fall back to the process-wide
    ``connect_timeout``, ``stage_read_timeout`` and ``health_timeout``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    connect: Annotated[float, Field(gt=0)] | None = None
    read: Annotated[float, Field(gt=0)] | None = None
    health: Annotated[float, Field(gt=0)] | None = None


@dataclass(frozen=True)
class ResolvedTimeouts:
    connect: float
    read: float
    health: float


class RuntimeSettings(BaseSettings):
    """Everything a stage, gateway or ``serve`` process reads at start-up."""

    model_config = SettingsConfigDict(env_prefix="OMNIMODEL_", extra="ignore", frozen=True)

    pipeline: Path | None = None
    stage: str | None = None
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8000
    # Clients must send ``Authorization: Bearer <key>`` when set (gateway only; stages sit behind a
    # NetworkPolicy that admits only the gateway and upstream stages).
    api_key: SecretStr | None = None
    model_cache: Path = Field(default_factory=_default_model_cache)
    # Root under which ``pvc://claim/path`` sources are mounted (``<root>/<claim>/<path>``).
    pvc_root: Path = Path("/mnt/pvc")
    device: Device = "auto"
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    # "json": every log line (the access log included) is one JSON object, for log collectors.
    log_format: Literal["text", "json"] = "text"

    # Gateway requests are JSON; a few MiB is plenty and keeps a flood of huge bodies cheap to refuse.
    max_body_bytes: Annotated[int, Field(gt=0)] = 4 * 1024 * 1024
    # Stage requests may carry tensors (a 15 MB hidden-state hand-off and far more for video).
    stage_max_body_bytes: Annotated[int, Field(gt=0)] = 1024 * 1024 * 1024
    # Chat images and videos given as http(s) URLs: fetched by the gateway only when true (off: a gateway
    # fetching any URL a client names reaches whatever its network reaches); data: URLs are always accepted.
    media_fetch: bool = False
    # The largest image or video the gateway fetches for one content part.
    media_max_bytes: Annotated[int, Field(gt=0)] = 20 * 1024 * 1024
    # Upper bound on one request end to end; becomes the deadline stages enforce.
    request_timeout: Annotated[float, Field(gt=0)] = 600.0
    # Connecting to a stage is a LAN hop; a dead pod must fail fast, not after the request timeout.
    connect_timeout: Annotated[float, Field(gt=0)] = 3.0
    # Longest silence tolerated between two frames of a stage response before it counts as hung (a
    # non-streamed request sends its one frame at the end, so this bounds a whole generation).
    stage_read_timeout: Annotated[float, Field(gt=0)] = 120.0
    # How often the gateway re-checks every stage endpoint's /health.
    health_interval: Annotated[float, Field(gt=0)] = 1.0
    # A stage's /health answers from its event loop while the engine works on its own thread, so it is
    # quick even under load; one slower than this is a hung process (SIGSTOP, a wedged node): the
    # endpoint leaves the pool at once and the requests waiting on it are failed over or failed.
    health_timeout: Annotated[float, Field(gt=0)] = 1.0
    # Per-stage overrides of the three stage timeouts, by stage name, e.g.
    # OMNIMODEL_STAGE_TIMEOUTS='{"denoise": {"read": 900}, "talker": {"health": 3}}'.
    stage_timeouts: dict[str, StageTimeouts] = Field(default_factory=dict)
    # Stages that may have no replica at all (scaled to zero by the operator's autoscaler), by name, with
    # how long a request for one is held while it wakes (seconds), e.g. OMNIMODEL_STAGE_WAKE='{"talker": 300}'.
    # Such a stage does not make /health 503; its held requests are what the autoscaler sees as
    # omnimodel_gateway_stage_waiting. Any other stage without a healthy endpoint fails requests at once.
    stage_wake: dict[str, Annotated[float, Field(gt=0)]] = Field(default_factory=dict)
    # Re-resolve stage hostnames (headless Services) to per-pod endpoints on every health poll.
    resolve_endpoints: bool = True
    # How long SIGTERM waits for in-flight requests before the process exits anyway (pods get 60 s).
    drain_timeout: Annotated[float, Field(ge=0)] = 30.0

    # What chat completions answer with when a request leaves ``modalities`` out (only the modalities the
    # pipeline outputs count). OpenAI's default is text; vLLM-Omni answers with every output modality, so
    # its Qwen-Omni clients, which leave it out, get audio only with '["text","audio"]'.
    chat_default_modalities: Annotated[list[Literal["text", "audio"]], Field(min_length=1)] = ["text"]

    # Batching engines may hold the first request of an idle engine this long (seconds) to start a
    # burst as one batch. 0 (default) starts at once: with continuous batching, requests arriving
    # a moment later join at the next step anyway, so waiting only adds latency.
    batch_wait: Annotated[float, Field(ge=0)] = 0.0
    max_batch_size: Annotated[int, Field(ge=1)] = 32

    # How long (seconds) a thread may hold the GIL while another waits for it (``sys.setswitchinterval``;
    # Python's default is 0.005). Stage workers hand frames to the event loop thread, which needs the GIL
    # for every wake-up: with Python's 5 ms and three busy omni workers in one process, Qwen2.5-Omni streams
    # on an H200 waited for it (only this changed, bench/omni_timeline.py: first audio of four streams at
    # once 2.2-2.4 s vs 0.89-1.05 s at 0.5 ms; latency of one 3.85-4.17 s vs 3.33-3.45 s).
    gil_switch_interval: Annotated[float, Field(gt=0)] = 0.0005

    # Threads this process computes with (torch intra-op, OpenMP, MKL, OpenBLAS, tokenizers). Unset: the
    # CPUs it may use (affinity, capped by its cgroup's quota), split among the stage processes its
    # pipeline file puts on this host (see cpu_threads_for). Every pool sized to the whole host in three
    # stage processes on one host made a Qwen2.5-Omni audio chat take 46-83 s instead of 1.9 s.
    cpu_threads: Annotated[int, Field(ge=1)] | None = None

    def timeouts_for(self, stage: str) -> ResolvedTimeouts:
        """The connect, read and health timeouts the gateway uses for ``stage``."""
        own = self.stage_timeouts.get(stage, StageTimeouts())
        return ResolvedTimeouts(
            connect=own.connect or self.connect_timeout,
            read=own.read or self.stage_read_timeout,
            health=own.health or self.health_timeout,
        )


# ------------------------------------------------------------------------------ CPUs and threads
# Read at start-up, before torch or numpy load: OpenMP and OpenBLAS size their pools once, when loaded.

CGROUP_ROOT: Final = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP: Final = Path("/proc/self/cgroup")
# What libraries size their thread pools from; a variable the user set is left as it is.
THREAD_ENV: Final = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "RAYON_NUM_THREADS",  # the pool of the tokenizers library
    "TOKENIZERS_PARALLELISM",
)


@dataclass(frozen=True)
class CpuBudget:
    """The CPUs a process may use: those its affinity allows (``taskset``, a cpuset), capped by its
    cgroup's CPU quota (a container's CPU limit). The kernel enforces a quota by throttling, not by hiding
    CPUs, so OpenMP never sees it: a pod limited to 2 CPUs on a 64-core node starts 64 threads."""

    affinity: int
    quota: float | None  # CPUs' worth of time per period (quota / period); None: no limit

    @property
    def usable(self) -> int:
        limit = self.affinity if self.quota is None else min(self.affinity, math.ceil(self.quota))
        return max(1, limit)


def cpu_budget(cgroup_root: Path = CGROUP_ROOT, self_cgroup: Path = PROC_SELF_CGROUP) -> CpuBudget:
    """This process's :class:`CpuBudget`, from ``os.sched_getaffinity`` and the cgroup files."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity API (macOS)
        affinity = os.cpu_count() or 1
    return CpuBudget(affinity=affinity, quota=cgroup_cpu_quota(cgroup_root, self_cgroup))


def cgroup_cpu_quota(cgroup_root: Path = CGROUP_ROOT, self_cgroup: Path = PROC_SELF_CGROUP) -> float | None:
    """The CPU quota of this process's cgroup in CPUs: ``cpu.max`` quota / period on cgroup v2, else
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` of the v1 ``cpu`` controller; the tightest of its own
    cgroup and its ancestors (a parent's limit binds its children). None when nothing limits it or
    nothing can be read.

    ``self_cgroup`` (``/proc/self/cgroup``) names the process's cgroup. In a container with its own cgroup
    namespace that is ``/`` and ``cgroup_root`` is the container's cgroup; without one it is the host's
    path, which the container's ``cgroup_root`` lacks: the levels that do not exist are skipped, down to
    the root itself.
    """
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return None
    v2: str | None = None
    v1: tuple[str, str] | None = None
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:
            v2 = path
        elif "cpu" in controllers.split(","):
            v1 = (controllers, path)
    # On a hybrid host the v2 tree has no cpu.max (the cpu controller is v1's): then v1 answers.
    if v2 is not None and (found := _levels(cgroup_root, v2, _cpu_max)):
        return _tightest(found)
    if v1 is not None:
        controllers, path = v1
        for mount in (cgroup_root / controllers, cgroup_root / "cpu"):  # "cpu,cpuacct" or its "cpu" link
            if mount.is_dir():
                return _tightest(_levels(mount, path, _cfs_quota))
    return None


def _levels(mount: Path, path: str, read: Callable[[Path], float | None]) -> list[float]:
    """What ``read`` finds in the cgroup at ``path`` and in each of its ancestors up to ``mount``."""
    parts = [p for p in path.split("/") if p and p != ".."]
    found = (read(mount.joinpath(*parts[:depth])) for depth in range(len(parts), -1, -1))
    return [q for q in found if q is not None]


def _tightest(quotas: list[float]) -> float | None:
    limit = min(quotas, default=math.inf)
    return None if math.isinf(limit) else limit


def _cpu_max(cgroup: Path) -> float | None:
    """cgroup v2 ``cpu.max``: ``max 100000`` (no limit: inf) or ``150000 100000`` (1.5 CPUs); None: absent."""
    try:
        quota, _, period = (cgroup / "cpu.max").read_text().strip().partition(" ")
    except OSError:
        return None
    return _ratio(quota, period or "100000")


def _cfs_quota(cgroup: Path) -> float | None:
    """cgroup v1 ``cpu.cfs_quota_us`` (-1: no limit, inf) over ``cpu.cfs_period_us``; None: absent."""
    try:
        quota = (cgroup / "cpu.cfs_quota_us").read_text().strip()
        period = (cgroup / "cpu.cfs_period_us").read_text().strip()
    except OSError:
        return None
    return _ratio(quota, period)


def _ratio(quota: str, period: str) -> float:
    try:
        q, p = int(quota), int(period)
    except ValueError:  # "max"
        return math.inf
    return q / p if q > 0 and p > 0 else math.inf


@dataclass(frozen=True)
class ThreadPlan:
    """How many threads a process computes with, and why."""

    count: int
    budget: CpuBudget
    # Where the count came from: "OMNIMODEL_CPU_THREADS", "OMP_NUM_THREADS" (set by the user) or "cpus".
    source: str
    # Stage processes on this host that share its CPUs (from "cpus" only; 1: this one alone).
    sharers: int = 1

    def describe(self) -> str:
        """Why ``count``, for the start-up log line."""
        quota = "none" if self.budget.quota is None else f"{self.budget.quota:g}"
        why = [f"affinity {self.budget.affinity}", f"cgroup quota {quota}"]
        if self.source != "cpus":
            why.insert(0, f"from {self.source}")
        elif self.sharers > 1:
            why.append(f"shared by {self.sharers} stage processes on this host")
        return ", ".join(why)


def plan_threads(budget: CpuBudget, *, setting: int | None, environ: Mapping[str, str], sharers: int = 1) -> ThreadPlan:
    """``setting`` (``OMNIMODEL_CPU_THREADS``) when given; else the ``OMP_NUM_THREADS`` the user set (the
    other pools follow it, as torch's does); else the usable CPUs split evenly among ``sharers`` processes,
    at least one each."""
    if setting is not None:
        return ThreadPlan(setting, budget, "OMNIMODEL_CPU_THREADS")
    omp = environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()  # "4,2": nested levels; the outer one
    if omp.isdigit() and int(omp) > 0:
        return ThreadPlan(int(omp), budget, "OMP_NUM_THREADS")
    sharers = max(1, sharers)
    return ThreadPlan(max(1, budget.usable // sharers), budget, "cpus", sharers)


def thread_env(count: int, environ: Mapping[str, str]) -> dict[str, str]:
    """The thread variables to set for ``count`` threads: those of :data:`THREAD_ENV` not in ``environ``.
    ``TOKENIZERS_PARALLELISM=false`` only for one thread (else tokenizers decides, within its pool)."""
    wanted = {name: str(count) for name in THREAD_ENV if name != "TOKENIZERS_PARALLELISM"}
    if count == 1:
        wanted["TOKENIZERS_PARALLELISM"] = "false"
    return {name: value for name, value in wanted.items() if name not in environ}
