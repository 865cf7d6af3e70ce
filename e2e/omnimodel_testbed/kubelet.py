"""Run pods' containers as local processes: the part of a kubelet the e2e suites need.

kwok makes pods Running and Ready without running anything. For tests that send real requests through
a gateway pod to stage pods, or that wait for a Job's pod to finish, :class:`PodRunner` plays the
kubelet for every pod of its namespace: kwok only gives those pods an IP (``runnerpods``), and the
runner runs their containers and writes their status.

A pod's init containers run first, one after the other, each to its end; then its first container.
Each is a process on this machine, bound to the pod's IP (inside the test bed's network namespace the
pod CIDR is local), with the container's env (values, Secret keys, the downward API's pod
IP/name/namespace, and ``$(VAR)`` references in command, args and env as the kubelet expands them).
Volumes are host directories: ConfigMaps written to files, emptyDirs per pod (or one of ``shared_dirs``
by volume name), and a PersistentVolumeClaim the directory of the hostPath volume it is bound to (the
runner binds the namespace's claims to volumes under ``claims_dir``, one directory per claim, shared by
every pod that mounts it, as a ReadWriteMany volume is). The container's paths in its arguments and env
values are rewritten to those directories (``subPath`` included), and a volume mounted at ``/tmp`` is
its ``TMPDIR`` (unless its env sets one), so temporary files stay the pod's. A read-only mount
(``readOnly``, and ConfigMap, Secret, projected and downward API volumes, which the kubelet always mounts
read-only) is read-only for the process, through a read-only bind mount in its own mount namespace.
Each container also gets its own empty ``/dev/shm`` there (a memory emptyDir mounted there sets its
size), so two pods can never meet through shared memory.

The pod's status is the kubelet's: Pending while init containers run (``Initialized``/``Ready`` False, the
running one ``running``, the others ``waiting``), Running once its first container has started, and Ready
(``ContainersReady`` too) while that container is ready. Its probes (``probes.py``) decide that as the
kubelet's prober does: a ``startupProbe`` gates the others and sets ``started``; a ``readinessProbe`` sets
``ready`` (none: ready once started), so the real controller-manager's EndpointSlices and Deployment
availability follow it; a ``livenessProbe`` (or startup probe) that reaches its ``failureThreshold`` has the
container killed (``Killing`` event) and restarted. ``httpGet``, ``tcpSocket`` and ``exec`` probes run on a
small thread pool, each failure an ``Unhealthy`` event; an ``exec`` runs inside the running container (its
root filesystem, mount namespace, user and env: ``container.exec_argv``; ``127.0.0.1`` in its command
is the pod's IP, since the pod's servers listen there). A container that exits is
``terminated`` with its exit code (128 + the signal's number when a signal ended it), reason
``Completed``/``Error`` and its termination message: the file at ``terminationMessagePath``
(``/dev/termination-log``, a file per container here), or with ``FallbackToLogsOnError`` the tail of its log
when it failed and left the file empty. The pod then finishes as the kubelet decides: ``restartPolicy:
Never`` makes it Succeeded or Failed (a failed init container fails the pod, and its first container never
starts), ``OnFailure`` restarts a failed container in place with the kubelet's back-off (immediately, then
10 s doubling to 5 min; ``restartCount`` counts; ``waiting``/``CrashLoopBackOff`` with the ended run as
``lastState`` meanwhile), ``Always`` restarts it whatever its exit code, and every policy but Never restarts
a failed init container. So the real Job controller sees its pods succeed, fail and count against
``backoffLimit`` and ``podFailurePolicy``. A container is killed as the kubelet kills it, on a thread of its
own: its ``lifecycle.preStop`` hook (``httpGet``, ``exec`` or ``sleep``; a failure is a
``FailedPreStopHook`` event and the kill goes on), then SIGTERM to its process group, then SIGKILL once what
is left of the grace period (counted from the hook's start, at least 2 s) has passed: the deletion's grace
period, else the pod's ``terminationGracePeriodSeconds`` (a liveness kill: the probe's, else the pod's). A
deleted pod stays in the API, Terminating (its EndpointSlice entry says so), while its container stops: kwok
leaves it to the runner until its grace period is over (``runnerpods.py``). Then the runner removes it
(grace period 0, its uid as precondition), and its IP goes. A pod force-deleted is stopped the same way,
with its spec's grace period. A container's group is also stopped when its process exits, as a container's
processes all end with it.

With an image store (``images.py``), every container runs from its image (``container.py``): pulled
from the test bed's registry as the pod's ``imagePullPolicy`` says (``ErrImagePull``, then
``ImagePullBackOff`` and the kubelet's events when it cannot be; ``imageID`` in its status), on an overlay
of the unpacked image with the image's env, entrypoint, user and working dir, the pod's securityContext
(uid/gid, ``readOnlyRootFilesystem``, ``fsGroup`` on its volumes), volumes at their mount paths, and
``KUBERNETES_SERVICE_*`` naming the API server. Then nothing is rewritten but a bind to ``0.0.0.0``, which
becomes the pod's IP (the test bed's pods share one network namespace). Without an image store the
command runs from ``bin_dir`` (this checkout's venv) with in-container paths rewritten to the volumes'
host directories. Either way a container whose command is ``vllm`` (the upstream vLLM-Omni image's
entrypoint) runs from the cached vLLM-Omni CPU environment (``omnimodel_testbed.vllm_omni``) with the CPU
platform plugin switched on: its upstream images cannot be pulled here, and an event says so.
Not emulated: resource limits; ``grpc`` probes and ``HTTPS`` ones (they fail, saying so); postStart hooks;
containers after the first (reported running, ready and Completed as it is; their probes and hooks are not
run); sidecar init containers (``restartPolicy: Always``: reported running, not run); without an image, a
path the program names itself rather than in its arguments or env (``/dev/termination-log`` hard-coded in a
program is the host's); pods that existed before the runner served the namespace (kwok plays them, nothing
runs).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import logging
import os
import re
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from . import podstatus as ps
from . import volumes as pv
from .container import ContainerMount, container_argv, exec_argv
from .images import Image, ImagePullError, ImageStore, image_user
from .kubeapi import ApiError, KubeAPI
from .netns import POD_INTERFACE
from .probes import ContainerProbes, HandlerTarget, run_handler
from .runnerpods import RUNNER_LABEL, serve_namespace
from .shm import DEFAULT_SHM_SIZE, private_shm_argv
from .vllm_omni import VLLM_OMNI_CPU_ENV
from .vllm_omni import ensure_env as ensure_vllm_omni_env

__all__ = ["PodProcess", "PodRunner", "expand_env_refs", "is_vllm_omni", "shm_size"]

JSON = dict[str, Any]

#: Where a container's termination message goes when its spec names no other path.
TERMINATION_LOG: Final = "/dev/termination-log"
#: The kubelet's restart back-off: the first restart at once, then 10 s, doubled per restart, at most 5 min.
RESTART_BACKOFF: Final = 10.0
MAX_RESTART_BACKOFF: Final = 300.0
#: The pod's grace period when its spec names none, and the least a container gets after its preStop hook
#: (the kubelet's ``minimumGracePeriodInSeconds``).
DEFAULT_GRACE: Final = 30.0
MIN_GRACE: Final = 2.0
#: Volume sources the kubelet always mounts read-only.
READ_ONLY_SOURCES: Final = ("configMap", "secret", "projected", "downwardAPI")

#: Executables that mark a vLLM-Omni container: the upstream image's entrypoint (``vllm serve``) and the
#: Mooncake master the operator runs beside it for its network connector.
VLLM_EXECUTABLES = ("vllm", "mooncake_master")

_ENV_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand_env_refs(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: defined names are replaced, ``$$`` escapes ``$``, the rest stays."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _ENV_REF.sub(sub, value)


def pod_address(ip: str, *, add: bool) -> None:
    """Put a pod's IP on the namespace's pod interface (or take it off), as a CNI puts it on the pod's
    eth0. Outside the test bed's network namespace (no such interface) there is nothing to do."""
    # /proc/net is the calling process's network namespace (/sys/class/net may still be the host's).
    names = {line.split(":", 1)[0].strip() for line in Path("/proc/net/dev").read_text().splitlines() if ":" in line}
    if POD_INTERFACE not in names:
        return
    ip_tool = shutil.which("ip") or shutil.which("ip", path="/usr/sbin:/sbin:/usr/bin:/bin") or "ip"
    verb = "add" if add else "del"
    result = subprocess.run(
        [ip_tool, "addr", verb, f"{ip}/32", "dev", POD_INTERFACE], capture_output=True, text=True, check=False
    )
    if result.returncode != 0 and "File exists" not in result.stderr and "Cannot assign" not in result.stderr:
        log.warning("ip addr %s %s failed: %s", verb, ip, result.stderr.strip())


def is_vllm_omni(container: Mapping[str, Any]) -> bool:
    """True when the container runs vLLM-Omni (its command is ``vllm ...``)."""
    argv = [*container.get("command", []), *container.get("args", [])]
    return bool(argv) and os.path.basename(argv[0]) in VLLM_EXECUTABLES


_QUANTITY = re.compile(r"^(\d+)(Ki|Mi|Gi|Ti|k|M|G|T)?$")
_TMPFS_SUFFIX = {"Ki": "k", "Mi": "m", "Gi": "g", "Ti": "t", "k": "k", "M": "m", "G": "g", "T": "t", None: ""}


def shm_size(pod: Mapping[str, Any]) -> str:
    """Size of the pod's /dev/shm: a memory emptyDir mounted there (its sizeLimit), else the runtime default.

    tmpfs sizes are binary (``1g`` = 1 GiB), so decimal quantities round up by at most 7%.
    """
    spec = pod["spec"]
    mounts = {
        m["name"] for c in spec["containers"] for m in c.get("volumeMounts") or [] if m["mountPath"] == "/dev/shm"
    }
    for volume in spec.get("volumes") or []:
        empty_dir = volume.get("emptyDir")
        if volume["name"] in mounts and isinstance(empty_dir, dict) and empty_dir.get("medium") == "Memory":
            m = _QUANTITY.match(str(empty_dir.get("sizeLimit", "")))
            # Unlimited memory emptyDir: half the host's memory, as tmpfs defaults to.
            return f"{m.group(1)}{_TMPFS_SUFFIX[m.group(2)]}" if m else "50%"
    return DEFAULT_SHM_SIZE


log = logging.getLogger("omnimodel_testbed")


@dataclass
class PodProcess:
    """One run of one container of a pod."""

    name: str
    uid: str
    ip: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    argv: list[str] = field(default_factory=list)
    container: str = ""
    #: Where this run's output begins in ``log_path`` (a restarted container appends to its log).
    log_offset: int = 0
    started_at: str = ""
    #: Where its probes and hooks go, and how a command runs inside it (``exec``).
    target: HandlerTarget | None = None
    #: When it started (monotonic seconds): probes count their initial delay from here.
    started: float = field(default_factory=time.monotonic)


@dataclass
class _PodRun:
    """What the runner knows of one pod it plays: the containers it runs in order (init containers, then
    the first container), which one is at, and the status it last wrote."""

    pod: JSON
    root: Path
    volumes: dict[str, Path]
    order: list[JSON]
    statuses: dict[str, JSON]
    start_time: str
    step: int = 0
    process: PodProcess | None = None
    #: The first container's latest process (what ``PodRunner.processes`` lists).
    main: PodProcess | None = None
    phase: str = "Pending"
    restarts: dict[str, int] = field(default_factory=dict)
    restart_at: float | None = None
    conditions: list[JSON] = field(default_factory=list)
    dirty: bool = True
    #: Image pulls under way or done, per container; failed pulls count towards the pull back-off.
    pulls: dict[str, Future[Image]] = field(default_factory=dict)
    pull_failures: dict[str, int] = field(default_factory=dict)
    pull_retry_at: float | None = None
    #: When a pull that had to fetch began (monotonic), per container: the Pulled event says how long it took.
    pulling: dict[str, float] = field(default_factory=dict)
    image_ids: dict[str, str] = field(default_factory=dict)
    #: The probes of the first container's current run (none while it is not running).
    probes: ContainerProbes | None = None
    #: Deleted: its container is being stopped, then the runner removes it.
    terminating: bool = False

    @property
    def name(self) -> str:
        return str(self.pod["metadata"]["name"])

    @property
    def spec(self) -> JSON:
        spec: JSON = self.pod["spec"]
        return spec

    @property
    def ip(self) -> str:
        return str(self.pod["status"]["podIP"])

    @property
    def at_main(self) -> bool:
        return self.step == len(self.order) - 1

    @property
    def finished(self) -> bool:
        return self.phase in ps.TERMINAL_PHASES


def _read_only_volumes(spec: Mapping[str, Any]) -> set[str]:
    """Names of the pod's volumes every mount of which is read-only (the kubelet's rule, or the claim's)."""
    return {
        v["name"]
        for v in spec.get("volumes") or []
        if any(k in v for k in READ_ONLY_SOURCES) or (v.get("persistentVolumeClaim") or {}).get("readOnly")
    }


def _apply_fs_group(path: Path, fs_group: int | None) -> None:
    """``fsGroup`` as the kubelet applies it to a volume that supports ownership management, under the
    default ``fsGroupChangePolicy: Always``: everything in it belongs to that group and is group-readable
    and writable (group-executable where the owner may execute), and directories pass the group on to new
    files (setgid). So a pod of the image's uid reads what another user left in a shared volume."""
    if fs_group is None or os.geteuid() != 0:
        return
    gid = int(fs_group)
    for root, dirs, files in os.walk(path):
        for name in [*dirs, *files]:
            _own(Path(root) / name, gid)
    _own(path, gid)


def _own(path: Path, gid: int) -> None:
    st = path.lstat()
    if stat.S_ISLNK(st.st_mode):
        return
    os.chown(path, -1, gid)
    mode = st.st_mode | 0o060 | (0o010 if st.st_mode & 0o100 else 0)
    if stat.S_ISDIR(st.st_mode):
        mode |= 0o2070
    os.chmod(path, stat.S_IMODE(mode))


def _run_order(spec: Mapping[str, Any]) -> list[JSON]:
    # Sidecars (init containers with restartPolicy Always) are not run: see the module docstring.
    init = [c for c in spec.get("initContainers") or [] if c.get("restartPolicy") != "Always"]
    return [*init, spec["containers"][0]]


class PodRunner:
    """Plays the kubelet for the pods of ``namespace``: runs their containers, writes their status.

    ``claims_dir`` holds one directory per claim (``<claims_dir>/<namespace>/<claim>``) that the runner
    binds to a volume (``bind_claims``); it defaults to ``<workdir>/_claims`` (no pod is named that).
    """

    def __init__(
        self,
        api: KubeAPI,
        namespace: str,
        workdir: Path,
        bin_dir: Path,
        *,
        shared_dirs: Mapping[str, Path] | None = None,
        extra_env: Mapping[str, str] | None = None,
        interval: float = 0.3,
        vllm_omni_env: Callable[[], Path] = ensure_vllm_omni_env,
        on_start: Callable[[PodProcess], None] | None = None,
        claims_dir: Path | None = None,
        bind_claims: bool = True,
        images: ImageStore | None = None,
        service_env: Mapping[str, str] | None = None,
    ) -> None:
        self.api = api
        self.namespace = namespace
        self.workdir = workdir
        self.bin_dir = bin_dir
        # volume name → host dir shared by every pod (e.g. the model cache, so a tiny model builds once)
        self.shared_dirs = dict(shared_dirs or {})
        self.extra_env = dict(extra_env or {})
        self.interval = interval
        # Resolved on the first vLLM-Omni pod only: suites without one never build that environment.
        self.vllm_omni_env = vllm_omni_env
        # Told about every process right after it starts (e.g. to record its PID for a later cleanup).
        self.on_start = on_start
        self.claims_dir = claims_dir or workdir / "_claims"
        self.bind_claims = bind_claims
        # Where containers' images come from: None runs every command from ``bin_dir`` (no image), as the
        # suites that test the operator alone do; with a store, every pod but vLLM-Omni's runs its image.
        self.images = images
        # What the kubelet puts in every container's environment for the ``kubernetes`` Service.
        self.service_env = dict(service_env or {})
        self._pull_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"pull-{namespace}")
        # Probes run here, a few at a time, so a slow one (its timeout) holds up neither the sync nor the rest.
        self._probe_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix=f"probe-{namespace}")
        # Containers being killed (a deleted pod's, a liveness failure's): each on a thread of its own, since
        # a preStop hook and the grace period after it may take as long as the pod's grace period.
        self._killers: list[tuple[threading.Thread, PodProcess]] = []
        # Deleted pods the runner has removed (or is removing), by uid: one DELETE each.
        self._removed: set[str] = set()
        self.pods: dict[str, _PodRun] = {}
        #: Names of the pods whose first container started, in order.
        self.started: list[str] = []
        #: PersistentVolumes this runner made for the namespace's claims (deleted by ``stop``).
        self.bound_volumes: list[str] = []
        self._unserved: set[str] = set()
        self._errors: dict[str, str] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Short names for the pods' /tmp directories (see _short_tmp), made on first use.
        self._short_tmp_dir: Path | None = None

    # ------------------------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Serve the namespace (pods created from now on are the runner's) and start syncing."""
        serve_namespace(self.api, self.namespace)
        self._thread = threading.Thread(target=self._loop, name=f"podrunner-{self.namespace}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        with self._lock:
            runs = list(self.pods.values())
            # Every pod told at once (they drain in parallel, as a node's pods do), then each awaited.
            for run in runs:
                if run.process is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(run.process.proc.pid, signal.SIGTERM)
            for _, process in self._killers:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.proc.pid, signal.SIGTERM)
            for run in runs:
                if run.process is not None:
                    self._terminate(run.process)
                if not run.finished:
                    pod_address(run.ip, add=False)
            self.pods.clear()
            # Kills under way see the stop (a sleep hook ends) and their process already signalled.
            for killer, _ in self._killers:
                killer.join(timeout=20)
            self._killers.clear()
            self._probe_pool.shutdown(wait=False, cancel_futures=True)
            for name in self.bound_volumes:
                try:
                    pv.release(self.api, name)
                except (ApiError, OSError) as exc:
                    log.warning("could not delete PersistentVolume %s: %s", name, exc)
            self.bound_volumes.clear()
            if self._short_tmp_dir is not None:
                shutil.rmtree(self._short_tmp_dir, ignore_errors=True)  # symlinks only: their targets stay
                self._short_tmp_dir = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync()
            except Exception:
                log.exception("pod runner sync failed")
            self._stop.wait(self.interval)

    def claim_dir(self, claim: str) -> Path:
        """The host directory the runner binds ``claim`` (of its namespace) to."""
        return self.claims_dir / self.namespace / claim

    # ----------------------------------------------------------------------------------------- sync
    def sync(self) -> None:
        """One pass: bind new claims, forget pods that went away, admit new ones, move each one on."""
        if self.bind_claims:
            self._bind_claims()
        pods = self.api.get(f"/api/v1/namespaces/{self.namespace}/pods").get("items", [])
        ours = {}
        # The runner's pods being deleted, with their deletion's grace period: the runner stops their
        # containers, then removes them, as a kubelet does (kwok leaves them to it: runnerpods.py).
        deleting: dict[str, tuple[JSON, float | None]] = {}
        for pod in pods:
            meta, status = pod["metadata"], pod.get("status") or {}
            if meta.get("deletionTimestamp"):
                if RUNNER_LABEL in (meta.get("labels") or {}):
                    grace = meta.get("deletionGracePeriodSeconds")
                    deleting[meta["uid"]] = (pod, None if grace is None else float(grace))
                continue
            if RUNNER_LABEL not in (meta.get("labels") or {}):
                if status.get("phase") == "Running" and meta["uid"] not in self._unserved:
                    self._unserved.add(meta["uid"])
                    log.warning(
                        "pod %s predates the runner in %s: kwok plays it, nothing runs", meta["name"], self.namespace
                    )
                continue
            if status.get("podIP"):
                ours[meta["uid"]] = pod
        with self._lock:
            self._killers = [k for k in self._killers if k[0].is_alive()]
            for uid, run in list(self.pods.items()):
                if uid in deleting:
                    if not run.terminating:
                        run.terminating = True
                        self._stop_pod(run, deleting[uid][1], remove=True)
                elif uid not in ours:
                    if not run.terminating:  # gone at once: force-deleted (grace period 0)
                        self._stop_pod(run, None, remove=False)
                    del self.pods[uid]
            for uid, (pod, _) in deleting.items():
                if uid not in self.pods and uid not in self._removed:
                    self._remove(pod)  # nothing runs for it (it finished, or never started here)
            for uid, pod in ours.items():
                try:
                    known = self.pods.get(uid)
                    if known is None and (pod.get("status") or {}).get("phase") in ps.TERMINAL_PHASES:
                        continue  # finished before this runner saw it
                    run = known if known is not None else self._admit(pod)
                    self.pods[uid] = run
                    self._advance(run)
                    if run.dirty:
                        self._write_status(run)
                    self._errors.pop(uid, None)
                except Exception as exc:
                    # One pod's trouble (a missing ConfigMap, an API error) stops neither the others nor
                    # the retries; it is logged once per distinct error.
                    if self._errors.get(uid) != str(exc):
                        self._errors[uid] = str(exc)
                        log.exception("pod %s: sync failed", pod["metadata"]["name"])

    def processes(self, name_prefix: str = "") -> list[PodProcess]:
        """The first container's process of each pod that has one, has not finished and is not being deleted."""
        with self._lock:
            return [
                r.main
                for r in self.pods.values()
                if r.main and not r.finished and not r.terminating and r.name.startswith(name_prefix)
            ]

    def _bind_claims(self) -> None:
        claims = self.api.get(f"/api/v1/namespaces/{self.namespace}/persistentvolumeclaims").get("items", [])
        for claim in claims:
            name = claim["metadata"]["name"]
            if (claim.get("spec") or {}).get("volumeName") or claim["metadata"].get("deletionTimestamp"):
                continue
            volume = pv.bind_claim(self.api, self.namespace, name, self.claim_dir(name))
            if volume not in self.bound_volumes:
                self.bound_volumes.append(volume)
                log.info("bound claim %s/%s to volume %s at %s", self.namespace, name, volume, self.claim_dir(name))

    # ---------------------------------------------------------------------------------- pod lifecycle
    def _admit(self, pod: JSON) -> _PodRun:
        root = self.workdir / pod["metadata"]["name"]
        root.mkdir(parents=True, exist_ok=True)
        spec = pod["spec"]
        order = _run_order(spec)
        statuses: dict[str, JSON] = {}
        for c in spec.get("initContainers") or []:
            sidecar = c.get("restartPolicy") == "Always"
            state = ps.running(ps.now()) if sidecar else ps.waiting("PodInitializing")
            statuses[c["name"]] = ps.container_status(c, state, ready=sidecar)
        first = ps.waiting("PodInitializing" if len(order) > 1 else "ContainerCreating")
        for c in spec["containers"]:
            statuses[c["name"]] = ps.container_status(c, first)
        run = _PodRun(pod, root, self._volumes(pod, root), order, statuses, ps.now())
        pod_address(run.ip, add=True)
        return run

    def _advance(self, run: _PodRun) -> None:
        if run.finished:
            return
        if run.process is not None:
            code = run.process.proc.poll()
            if code is None:
                if run.probes is not None:
                    self._probe(run, run.process)
                return
            # Killed by a signal: the runtime's exit code is 128 + the signal's number.
            self._exited(run, run.process, 128 - code if code < 0 else code)
            run.process, run.probes = None, None
            run.dirty = True
        if run.finished or (run.restart_at is not None and time.monotonic() < run.restart_at):
            return
        self._start_next(run)

    def _start_next(self, run: _PodRun) -> None:
        container = run.order[run.step]
        name = container["name"]
        image = None
        if self.images is not None and not is_vllm_omni(container):
            image = self._pulled(run, container)
            if image is None:
                return  # pulling, or backing off after a failed pull
        elif is_vllm_omni(container) and name not in run.image_ids:
            run.image_ids[name] = ""
            self._event(
                run, container, "Normal", "ImageNotPulled",
                f'Container image "{container.get("image", "")}" not pulled: vLLM-Omni\'s upstream images cannot be '
                "pulled here; the container runs from the test bed's cached vLLM-Omni CPU environment",
            )  # fmt: skip
        proc = self._start(run.pod, container, run.volumes, run.root, init=not run.at_main, image=image)
        run.process, run.restart_at, run.dirty = proc, None, True
        if run.at_main:
            run.probes = ContainerProbes.of(container, proc.started)
        self._running_status(run, proc)
        if run.at_main:
            run.main, run.phase = proc, "Running"
            if run.restarts.get(name, 0) == 0:
                self.started.append(run.name)
        if self.on_start is not None:
            self.on_start(proc)

    def _running_status(self, run: _PodRun, proc: PodProcess) -> None:
        """The running container's status: ``started`` and ``ready`` as its probes say (an init container is
        never ready); the containers after the first say what it says."""
        container = run.order[run.step]
        name = container["name"]
        started = run.probes.started if run.probes is not None else True
        ready = run.probes.ready if run.probes is not None else False
        previous = run.statuses[name]
        run.statuses[name] = ps.container_status(
            container,
            ps.running(proc.started_at),
            ready=ready,
            started=started,
            restart_count=run.restarts.get(name, 0),
            last_state=previous.get("lastState"),
        )
        if run.at_main:
            self._others(run, ps.running(proc.started_at), ready=ready)

    # ------------------------------------------------------------------------------------------ probes
    def _probe(self, run: _PodRun, proc: PodProcess) -> None:
        """Collect the probes that finished (their results may change the container's status, or have it
        killed), then start the ones that are due, on the probe pool."""
        probes = run.probes
        assert probes is not None and proc.target is not None
        container = run.order[run.step]
        now = time.monotonic()
        for kind, future in list(probes.pending.items()):
            if not future.done():
                continue
            del probes.pending[kind]
            prober = probes.get(kind)
            ok, message = future.result()
            if not ok:
                self._event(run, container, "Warning", "Unhealthy", f"{kind} probe failed: {message}".rstrip())
            outcome = probes.record(prober, ok, time.monotonic())
            if outcome.changed:
                self._running_status(run, proc)
                run.dirty = True
                log.info("pod %s: %s started=%s ready=%s", run.name, proc.container, probes.started, probes.ready)
            if outcome.kill:
                self._event(
                    run, container, "Normal", "Killing",
                    f"Container {proc.container} failed {kind.lower()} probe, will be restarted",
                )  # fmt: skip
                grace = prober.spec.get("terminationGracePeriodSeconds")
                self._kill_async(run, proc, container, self._grace(run) if grace is None else float(grace))
        for prober in probes.due(now):
            probes.pending[prober.kind] = self._probe_pool.submit(run_handler, prober.spec, proc.target, prober.timeout)

    # ------------------------------------------------------------------------------------------ images
    def _pulled(self, run: _PodRun, container: Mapping[str, Any]) -> Image | None:
        """The container's image once pulled; until then None, with the kubelet's waiting states and events
        (``ContainerCreating`` while pulling; ``ErrImagePull``, then ``ImagePullBackOff`` between retries
        that back off from 10 s, doubling, to 5 min)."""
        assert self.images is not None
        name, reference = container["name"], str(container.get("image") or "")
        policy = container.get("imagePullPolicy") or ("Always" if reference.endswith(":latest") else "IfNotPresent")
        restarts = run.restarts.get(name, 0)
        future = run.pulls.get(name)
        if future is None:
            if run.pull_retry_at is not None and time.monotonic() < run.pull_retry_at:
                state = run.statuses[name].get("state", {}).get("waiting") or {}
                if state.get("reason") == "ErrImagePull":
                    message = f'Back-off pulling image "{reference}": ErrImagePull: {state.get("message", "")}'
                    run.statuses[name] = ps.container_status(
                        container, ps.waiting("ImagePullBackOff", message), restart_count=restarts
                    )
                    run.dirty = True
                    self._event(run, container, "Normal", "BackOff", f'Back-off pulling image "{reference}"')
                return None
            run.pull_retry_at = None
            if policy != "Always" and self.images.present(reference):
                self._event(
                    run, container, "Normal", "Pulled", f'Container image "{reference}" already present on machine'
                )
            else:
                self._event(run, container, "Normal", "Pulling", f'Pulling image "{reference}"')
                run.pulling[name] = time.monotonic()
            run.pulls[name] = self._pull_pool.submit(self.images.pull, reference, policy)
            return None
        if not future.done():
            return None
        del run.pulls[name]
        error = future.exception()
        if error is None:
            image = future.result()
            started = run.pulling.pop(name, None)
            if started is not None:
                seconds = time.monotonic() - started
                self._event(
                    run, container, "Normal", "Pulled", f'Successfully pulled image "{reference}" in {seconds:.3f}s'
                )
            run.image_ids[name] = image.image_id
            run.pull_failures.pop(name, None)
            return image
        run.pulling.pop(name, None)
        reason = error.reason if isinstance(error, ImagePullError) else "ErrImagePull"
        failures = run.pull_failures.get(name, 0) + 1
        run.pull_failures[name] = failures
        run.pull_retry_at = time.monotonic() + min(RESTART_BACKOFF * 2 ** (failures - 1), MAX_RESTART_BACKOFF)
        if reason == "ErrImagePull":
            message = f'failed to pull and unpack image "{reference}": {error}'
            self._event(run, container, "Warning", "Failed", f'Failed to pull image "{reference}": {error}')
        else:
            message = str(error)
            self._event(run, container, "Warning", "ErrImageNeverPull", message)
        self._event(run, container, "Warning", "Failed", f"Error: {reason}")
        log.warning("pod %s: %s", run.name, message)
        run.statuses[name] = ps.container_status(container, ps.waiting(reason, message), restart_count=restarts)
        run.dirty = True
        return None

    def _event(self, run: _PodRun, container: Mapping[str, Any], kind: str, reason: str, message: str) -> None:
        """An Event about the pod's container, as the kubelet records it (``kubectl describe pod`` shows it)."""
        meta = run.pod["metadata"]
        now = ps.now()
        main = any(c["name"] == container["name"] for c in run.spec["containers"])
        field_path = f"spec.{'containers' if main else 'initContainers'}{{{container['name']}}}"
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": self.namespace},
            "involvedObject": {
                "apiVersion": "v1",
                "kind": "Pod",
                "namespace": self.namespace,
                "name": meta["name"],
                "uid": meta["uid"],
                "fieldPath": field_path,
            },
            "reason": reason,
            "message": message,
            "type": kind,
            "source": {"component": "kubelet", "host": run.spec.get("nodeName", "")},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            self.api.create(f"/api/v1/namespaces/{self.namespace}/events", event)
        except ApiError as exc:
            log.warning("pod %s: could not record event %s: %s", meta["name"], reason, exc)

    def _exited(self, run: _PodRun, proc: PodProcess, code: int) -> None:
        container = run.order[run.step]
        name, init = container["name"], not run.at_main
        # The container's processes end with it, as they do when its PID namespace's first process exits.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.proc.pid, signal.SIGKILL)
        message = ps.termination_message(
            container, self._termination_file(run.root, name), proc.log_path, proc.log_offset, code
        )
        state = ps.terminated(code, message, proc.started_at, ps.now())
        restarts = run.restarts.get(name, 0)
        policy = run.spec.get("restartPolicy", "Always")
        kind = "init container" if init else "container"
        log.info("pod %s: %s %s exited with %d", run.name, kind, name, code)
        if code == 0 and init:
            run.statuses[name] = ps.container_status(container, state, restart_count=restarts)
            run.step += 1
        elif (code == 0 and policy != "Always") or (code != 0 and policy == "Never"):
            run.statuses[name] = ps.container_status(container, state, restart_count=restarts)
            run.phase = "Succeeded" if code == 0 else "Failed"
            if init:
                log.warning("pod %s: init container %s failed; its containers do not start", run.name, name)
            else:
                self._others(run, ps.terminated(0, "", proc.started_at, ps.now()))
            pod_address(run.ip, add=False)
        else:
            # Restarted in place (OnFailure, Always, and a failed init container of either) after the back-off.
            restarts += 1
            run.restarts[name] = restarts
            delay = 0.0 if restarts == 1 else min(RESTART_BACKOFF * 2 ** (restarts - 2), MAX_RESTART_BACKOFF)
            run.restart_at = time.monotonic() + delay
            waiting = ps.waiting(
                "CrashLoopBackOff", f"back-off {delay:.0f}s restarting failed container={name} pod={run.name}"
            )
            run.statuses[name] = ps.container_status(container, waiting, restart_count=restarts, last_state=state)
            log.info("pod %s: %s %s restarts in %.0fs (restart %d)", run.name, kind, name, delay, restarts)
            if not init:
                self._others(run, waiting)

    def _others(self, run: _PodRun, state: JSON, *, ready: bool = False) -> None:
        """Containers after the first are not run: they report what the first one does."""
        for c in run.spec["containers"][1:]:
            run.statuses[c["name"]] = ps.container_status(c, state, ready=ready)

    def _write_status(self, run: _PodRun) -> None:
        spec = run.spec
        for name, image_id in run.image_ids.items():
            if image_id and name in run.statuses:
                run.statuses[name]["imageID"] = image_id
        status = ps.pod_status(
            spec,
            run.phase,
            [run.statuses[c["name"]] for c in spec.get("initContainers") or []],
            [run.statuses[c["name"]] for c in spec["containers"]],
            start_time=run.start_time,
            previous_conditions=run.conditions,
        )
        try:
            self.api.patch(
                f"/api/v1/namespaces/{self.namespace}/pods/{run.name}/status", {"status": status}, strategic=True
            )
        except ApiError as exc:
            if exc.status != 404:  # gone: the next sync forgets it
                raise
        run.conditions, run.dirty = status["conditions"], False

    def _stop_pod(self, run: _PodRun, grace: float | None, *, remove: bool) -> None:
        """The pod was deleted: its running container is killed as the kubelet kills it (``_kill``), with the
        deletion's grace period (else the spec's); then its IP goes and (``remove``) the runner removes it."""
        process, run.process = run.process, None
        if process is None or process.proc.poll() is not None:
            if process is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.proc.pid, signal.SIGKILL)  # what it left behind
            self._stopped(run, remove=remove)
            return
        self._kill_async(
            run, process, run.order[run.step], self._grace(run) if grace is None else grace, gone=True, remove=remove
        )

    def _stopped(self, run: _PodRun, *, remove: bool) -> None:
        """A deleted pod's container has stopped: its IP goes (unless a newer pod has it already), and the
        runner removes the pod (``remove``)."""
        # A snapshot without the lock (stop() holds it while it waits for the killers).
        others = [r for r in list(self.pods.values()) if r is not run and not r.finished]
        if not run.finished and all(r.ip != run.ip for r in others):
            pod_address(run.ip, add=False)
        if remove:
            self._remove(run.pod)

    def _remove(self, pod: Mapping[str, Any]) -> None:
        """Delete the pod's object at once (the kubelet's last word on a deleted pod), only if it is still
        the same pod (its uid)."""
        meta = pod["metadata"]
        self._removed.add(meta["uid"])
        options = {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0,
                   "preconditions": {"uid": meta["uid"]}}  # fmt: skip
        try:
            self.api.request("DELETE", f"/api/v1/namespaces/{self.namespace}/pods/{meta['name']}", options)
            log.info("removed deleted pod %s", meta["name"])
        except ApiError as exc:
            if exc.status not in (404, 409):  # gone already, or a new pod of that name
                log.warning("could not remove pod %s: %s", meta["name"], exc)

    @staticmethod
    def _grace(run: _PodRun) -> float:
        value = run.spec.get("terminationGracePeriodSeconds")
        return DEFAULT_GRACE if value is None else float(value)

    def _kill_async(
        self,
        run: _PodRun,
        proc: PodProcess,
        container: Mapping[str, Any],
        grace: float,
        *,
        gone: bool = False,
        remove: bool = False,
    ) -> None:
        killer = threading.Thread(
            target=self._kill, args=(run, proc, container, grace, gone, remove), name=f"kill-{run.name}", daemon=True
        )
        self._killers.append((killer, proc))
        killer.start()

    def _kill(
        self, run: _PodRun, proc: PodProcess, container: Mapping[str, Any], grace: float, gone: bool, remove: bool
    ) -> None:
        """Kill one container as the kubelet does: its ``preStop`` hook first (bounded by the grace period),
        then SIGTERM, then SIGKILL once what is left of the grace period (at least 2 s) has passed. A hook
        that fails is a ``FailedPreStopHook`` event, and the kill goes on. ``gone``: the pod was deleted, so
        its IP goes too once the container has stopped, and (``remove``) the pod itself."""
        begin = time.monotonic()
        name = container["name"]
        if gone:
            self._event(run, container, "Normal", "Killing", f"Stopping container {name}")
        hook = (container.get("lifecycle") or {}).get("preStop")
        if hook and grace > 0 and proc.target is not None and proc.proc.poll() is None:
            log.info("pod %s: running the preStop hook of container %s", run.name, name)
            ok, message = run_handler(hook, proc.target, grace, hook=True, stop=self._stop)
            if not ok:
                meta = run.pod["metadata"]
                what = "Exec" if "exec" in hook else "HTTP" if "httpGet" in hook else "Lifecycle"
                detail = (hook.get("exec") or {}).get("command") or (hook.get("httpGet") or {}).get("path", "")
                self._event(
                    run, container, "Warning", "FailedPreStopHook",
                    f'{what} lifecycle hook ({detail}) for Container "{name}" in Pod '
                    f'"{meta["name"]}_{self.namespace}({meta["uid"]})" failed - error: {message}',
                )  # fmt: skip
                log.warning("pod %s: preStop hook of container %s failed: %s", run.name, name, message)
        self._terminate(proc, grace=max(grace - (time.monotonic() - begin), MIN_GRACE))
        if gone:
            self._stopped(run, remove=remove)

    # --------------------------------------------------------------------------------------- launch
    def _secret_value(self, ref: Mapping[str, Any]) -> str:
        secret = self.api.get(f"/api/v1/namespaces/{self.namespace}/secrets/{ref['name']}")
        return base64.b64decode(secret["data"][ref["key"]]).decode()

    def _volumes(self, pod: Mapping[str, Any], root: Path) -> dict[str, Path]:
        """volume name → host directory holding its content."""
        out: dict[str, Path] = {}
        fs_group = (pod["spec"].get("securityContext") or {}).get("fsGroup")
        for volume in pod["spec"].get("volumes") or []:
            name = volume["name"]
            claim = volume.get("persistentVolumeClaim")
            if claim is not None:
                # Where the volume the claim is bound to lives, as the kubelet mounts what the PV names; a
                # claim is shared storage already, so never one of ``shared_dirs`` (those stand in for it).
                path = pv.claim_host_path(self.api, self.namespace, claim["claimName"])
                out[name] = path or self.claim_dir(claim["claimName"])
                out[name].mkdir(parents=True, exist_ok=True)
                _apply_fs_group(out[name], fs_group)
                continue
            if name in self.shared_dirs:
                out[name] = self.shared_dirs[name]
                out[name].mkdir(parents=True, exist_ok=True)
                _apply_fs_group(out[name], fs_group)
                continue
            target = root / "volumes" / name
            target.mkdir(parents=True, exist_ok=True)
            if "emptyDir" in volume:
                target.chmod(0o777)  # an emptyDir is world-writable, whatever user the pod runs as
                _apply_fs_group(target, fs_group)
            sources = [volume] if "configMap" in volume else (volume.get("projected") or {}).get("sources") or []
            for source in sources:
                if "configMap" in source:
                    self._write_configmap(source["configMap"], target)
                elif "serviceAccountToken" in source:
                    self._write_token(pod, source["serviceAccountToken"], target)
                elif "downwardAPI" in source:
                    for item in source["downwardAPI"].get("items") or []:
                        value = self._field_value(pod, item["fieldRef"]["fieldPath"])
                        (target / item["path"]).write_text(value)
            out[name] = target
        return out

    def _write_configmap(self, ref: Mapping[str, Any], target: Path) -> None:
        """A configMap volume or projected source: every key as a file, or only ``items`` (key → path)."""
        cm = self.api.get(f"/api/v1/namespaces/{self.namespace}/configmaps/{ref['name']}")
        data = cm.get("data") or {}
        items = ref.get("items") or [{"key": k, "path": k} for k in data]
        for item in items:
            (target / item["path"]).write_text(data[item["key"]])

    def _write_token(self, pod: Mapping[str, Any], source: Mapping[str, Any], target: Path) -> None:
        """A projected ServiceAccount token, bound to the pod, from the TokenRequest API (what the kubelet
        asks for the ``kube-api-access-*`` volume the ServiceAccount admission adds to every pod)."""
        meta = pod["metadata"]
        account = pod["spec"].get("serviceAccountName") or "default"
        request: JSON = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "expirationSeconds": int(source.get("expirationSeconds", 3607)),
                "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"]},
                **({"audiences": [source["audience"]]} if source.get("audience") else {}),
            },
        }
        answer = self.api.create(f"/api/v1/namespaces/{self.namespace}/serviceaccounts/{account}/token", request)
        (target / source.get("path", "token")).write_text(answer["status"]["token"])

    def _field_value(self, pod: Mapping[str, Any], path: str) -> str:
        """The downward API's ``fieldRef`` values a stage pod uses."""
        values = {
            "status.podIP": pod["status"].get("podIP", ""),
            "status.hostIP": pod["status"].get("hostIP", ""),
            "metadata.name": pod["metadata"]["name"],
            "metadata.namespace": pod["metadata"].get("namespace", self.namespace),
            "metadata.uid": pod["metadata"].get("uid", ""),
            "spec.nodeName": pod["spec"].get("nodeName", ""),
        }
        if path not in values:
            raise ValueError(f"fieldRef {path} is not emulated by the test bed's pod runner")
        return str(values[path])

    @staticmethod
    def _termination_file(root: Path, container: str) -> Path:
        return root / f"{container}.termination-log"

    def _start(
        self,
        pod: Mapping[str, Any],
        container: Mapping[str, Any],
        volumes: Mapping[str, Path],
        root: Path,
        *,
        init: bool,
        image: Image | None = None,
    ) -> PodProcess:
        """Start one container of the pod as a process (its own session, mount namespace and /dev/shm):
        inside its image when it has one, else from ``bin_dir`` (see the module docstring)."""
        if image is not None:
            return self._start_in_image(pod, container, volumes, root, init=init, image=image)
        ip = pod["status"]["podIP"]
        read_only_volumes = _read_only_volumes(pod["spec"])
        mounts: list[tuple[str, Path]] = []
        read_only: list[Path] = []
        for m in container.get("volumeMounts") or []:
            if m["mountPath"] == "/dev/shm":
                continue  # the pod's private tmpfs (below), not a host directory
            host = volumes[m["name"]]
            if m.get("subPath"):
                host = host / m["subPath"]
                if not host.exists():
                    host.mkdir(parents=True)  # as the kubelet creates a missing subPath
            mounts.append((m["mountPath"], host))
            if m.get("readOnly") or m["name"] in read_only_volumes:
                read_only.append(host)
        # The kubelet mounts an empty file there; what the container leaves in it is its termination message.
        message_file = self._termination_file(root, container["name"])
        message_file.write_bytes(b"")
        mounts.append((container.get("terminationMessagePath") or TERMINATION_LOG, message_file))
        mounts.sort(key=lambda item: -len(item[0]))  # longest mount path first: /models/hf before /models

        def host_path(value: str) -> str:
            for mount_path, host in mounts:
                if value == mount_path or value.startswith(mount_path + "/"):
                    return str(host) + value[len(mount_path) :]
            return value

        env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "PYTHONPATH")}
        if env.get("PYTHONPATH"):
            # The pod runs in its own directory: a relative entry (`PYTHONPATH=operator:runtime:e2e`, this
            # checkout's code) would name nothing there, and the venv's installed copy would run instead.
            env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in env["PYTHONPATH"].split(os.pathsep) if p)
        if is_vllm_omni(container):
            # The vLLM-Omni env's own Python, never this checkout's (its pins conflict); the container's own
            # PYTHONPATH (below) still applies, as in its image.
            env.pop("PYTHONPATH", None)
        container_env = self._container_env(pod, container)
        for key, value in container_env.items():
            env[key] = host_path(value)

        tmp = host_path("/tmp")
        if tmp != "/tmp" and "TMPDIR" not in env:
            # A program's own temporary files (tempfile, mkstemp) go where /tmp is in its container: the
            # pod's volume, not the host's /tmp that every pod would share.
            env["TMPDIR"] = self._short_tmp(tmp)

        argv = [expand_env_refs(a, container_env) for a in [*container.get("command", []), *container.get("args", [])]]
        vllm_omni = is_vllm_omni(container)
        # The arguments are the container's and may name in-container paths; the executable is ours
        # (and may itself live under a path such as /tmp that a pod mounts over).
        bin_dir = self.vllm_omni_env() / "bin" if vllm_omni else self.bin_dir
        exe = bin_dir / argv[0]
        args = [ip if a == "0.0.0.0" else host_path(a) for a in argv[1:]]
        argv = [str(exe) if exe.exists() else argv[0], *args]
        env.update(self.extra_env)
        if vllm_omni:
            # The vLLM-Omni env's own tools, never this checkout's.
            env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
            env.update(VLLM_OMNI_CPU_ENV)

        def enter(_pid: int, command: Sequence[str]) -> list[str]:
            # No image: a command runs here as the container's own does (from the same bin dir, its
            # in-container paths rewritten).
            exe = bin_dir / command[0]
            return [str(exe) if exe.exists() else command[0], *(host_path(a) for a in command[1:])]

        return self._spawn(
            pod, container, root, private_shm_argv(argv, shm_size(pod), read_only), argv, env, init, enter
        )

    def _spawn(
        self,
        pod: Mapping[str, Any],
        container: Mapping[str, Any],
        root: Path,
        full_argv: list[str],
        argv: list[str],
        env: Mapping[str, str],
        init: bool,
        enter: Callable[[int, Sequence[str]], list[str]],
    ) -> PodProcess:
        """Start the container's process; ``enter(pid, command)`` is the argv that runs a command inside it
        (an ``exec`` probe or hook)."""
        meta = pod["metadata"]
        ip = pod["status"]["podIP"]
        # The first container's log keeps its old name (README and suites point at it).
        log_path = root / (f"init-{container['name']}.log" if init else "container.log")
        with log_path.open("ab") as out:
            offset = out.tell()
            # Own session: the container's processes form one group, stopped together (see _terminate).
            proc = subprocess.Popen(
                full_argv, stdout=out, stderr=subprocess.STDOUT, env=dict(env), cwd=root, start_new_session=True
            )
        what = f"init container {container['name']} of pod" if init else "pod"
        log.info("started %s %s (%s) as pid %d: %s", what, meta["name"], ip, proc.pid, " ".join(argv))
        ports = {p["name"]: int(p["containerPort"]) for p in container.get("ports") or [] if p.get("name")}
        # The pod's loopback is its IP here (its servers listen there, not on a 127.0.0.1 of their own): an
        # exec handler's 127.0.0.1 becomes the pod's IP, as the command's 0.0.0.0 did.
        target = HandlerTarget(
            ip,
            ports,
            lambda command: enter(proc.pid, [a.replace("127.0.0.1", ip) for a in command]),
            dict(env),
            str(root),
        )
        return PodProcess(
            meta["name"], meta["uid"], ip, proc, log_path, argv, container["name"], offset, ps.now(), target
        )

    def _container_env(self, pod: Mapping[str, Any], container: Mapping[str, Any]) -> dict[str, str]:
        """The container's own ``env``, in order, ``$(VAR)`` references expanded as the kubelet does."""
        container_env: dict[str, str] = {}
        for item in container.get("env") or []:
            source = item.get("valueFrom") or {}
            if "value" in item:
                value = expand_env_refs(item["value"], container_env)
            elif "secretKeyRef" in source:
                value = self._secret_value(source["secretKeyRef"])
            elif "fieldRef" in source:
                value = self._field_value(pod, source["fieldRef"]["fieldPath"])
            else:
                continue
            container_env[item["name"]] = value
        return container_env

    def _start_in_image(
        self,
        pod: Mapping[str, Any],
        container: Mapping[str, Any],
        volumes: Mapping[str, Path],
        root: Path,
        *,
        init: bool,
        image: Image,
    ) -> PodProcess:
        """Start one container inside its image's root filesystem (``container.py``): the image's env, user
        and working dir under the pod's env, securityContext, volumes at their mount paths and its own
        /dev/shm, /etc/hosts and hostname. Paths are the container's own; nothing is rewritten but a bind to
        ``0.0.0.0``, which becomes the pod's IP (the test bed's pods share one network namespace)."""
        meta, spec = pod["metadata"], pod["spec"]
        ip = pod["status"]["podIP"]
        name = container["name"]
        read_only_volumes = _read_only_volumes(spec)
        mounts = [
            ContainerMount(
                volumes[m["name"]] / m["subPath"] if m.get("subPath") else volumes[m["name"]],
                m["mountPath"],
                bool(m.get("readOnly")) or m["name"] in read_only_volumes,
            )
            for m in container.get("volumeMounts") or []
            if m["mountPath"] != "/dev/shm"  # the container's private tmpfs
        ]
        for m in mounts:
            if not m.source.exists():
                m.source.mkdir(parents=True, mode=0o777)  # as the kubelet creates a missing subPath
        message_file = self._termination_file(root, name)
        message_file.write_bytes(b"")
        message_file.chmod(0o666)  # the container's user writes it
        etc = root / "etc" / name
        etc.mkdir(parents=True, exist_ok=True)
        hosts = f"127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n{ip}\t{meta['name']}\n"
        (etc / "hosts").write_text(hosts)
        (etc / "hostname").write_text(f"{meta['name']}\n")
        mounts += [
            ContainerMount(message_file, container.get("terminationMessagePath") or TERMINATION_LOG),
            ContainerMount(etc / "hosts", "/etc/hosts"),
            ContainerMount(etc / "hostname", "/etc/hostname"),
            ContainerMount(Path("/etc/resolv.conf"), "/etc/resolv.conf", read_only=True),
        ]

        # Image env, then the kubelet's, then the pod's own: a later definition wins.
        env = dict(item.split("=", 1) for item in image.env if "=" in item)
        env.update({"HOSTNAME": meta["name"], **self.service_env})
        container_env = self._container_env(pod, container)
        env.update(container_env)
        env.update(self.extra_env)

        # Kubernetes' rule: command replaces the ENTRYPOINT (and drops CMD), args replace CMD.
        command = [expand_env_refs(a, container_env) for a in container.get("command") or []]
        args = [expand_env_refs(a, container_env) for a in container.get("args") or []]
        argv = [*command, *args] if command else [*image.entrypoint, *(args or image.cmd)]
        # "Listen everywhere" means the pod's own IP: the test bed's pods share one network namespace.
        argv = [a.replace("0.0.0.0", ip) for a in argv]
        if not argv:
            raise ValueError(f"container {name} has no command and its image {image.reference} none either")

        pod_context = spec.get("securityContext") or {}
        context = container.get("securityContext") or {}
        uid, gid = image_user(
            image,
            context.get("runAsUser", pod_context.get("runAsUser")),
            context.get("runAsGroup", pod_context.get("runAsGroup")),
        )
        if (context.get("runAsNonRoot", pod_context.get("runAsNonRoot"))) and uid == 0:
            raise ValueError(f"container {name} has runAsNonRoot and image will run as root")
        state = root / "containers" / name
        shutil.rmtree(state, ignore_errors=True)  # a new container's writable layer starts empty
        working_dir = container.get("workingDir") or image.working_dir
        full_argv = container_argv(
            argv,
            image_root=image.rootfs,
            state=state,
            hostname=meta["name"][:63],
            mounts=mounts,
            shm_size=shm_size(pod),
            uid=uid,
            gid=gid,
            working_dir=working_dir,
            read_only_root=bool(context.get("readOnlyRootFilesystem")),
        )

        def enter(pid: int, command: Sequence[str]) -> list[str]:
            return exec_argv(pid, command, state=state, uid=uid, gid=gid, working_dir=working_dir)

        return self._spawn(pod, container, root, full_argv, argv, env, init, enter)

    @staticmethod
    def _terminate(pod: PodProcess, grace: float = 15.0) -> None:
        # The group is the session the pod's process leads (start_new_session): the process and every child
        # it left in it (engine cores, workers), and nothing else. A leader that already exited may leave
        # children behind, so the group is signalled even then.
        pgid = pod.proc.pid

        def signal_group(sig: signal.Signals) -> None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, sig)

        signal_group(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            pod.proc.wait(timeout=grace)
        signal_group(signal.SIGKILL)
        if pod.proc.poll() is None:
            pod.proc.wait(timeout=5)
        log.info("stopped pod %s (pid %d, exit %s)", pod.name, pod.proc.pid, pod.proc.returncode)

    def _short_tmp(self, directory: str) -> str:
        """A short path to ``directory`` (a symlink): in a container /tmp is 4 characters, and programs put
        Unix sockets there (vLLM's ZMQ IPC), whose paths may not exceed 107 bytes; the pod's volume
        directory under a test's work dir already takes 90."""
        if self._short_tmp_dir is None:
            self._short_tmp_dir = Path(tempfile.mkdtemp(prefix="tb-", dir="/tmp"))
        link = self._short_tmp_dir / hashlib.sha256(directory.encode()).hexdigest()[:10]
        if not link.is_symlink():
            link.symlink_to(directory, target_is_directory=True)
        return str(link)

    def cleanup(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)
