"""Run pods' containers as local processes: the part of a kubelet the serving e2e needs.

kwok makes pods Running and Ready without running anything. For tests that send real requests
through a gateway pod to stage pods, :class:`PodRunner` starts each pod's container command as a
process on this machine, bound to the pod's IP (inside the test bed's network namespace the pod CIDR
is local), with the pod's env (values, Secret keys, the downward API's pod IP/name/namespace, and ``$(VAR)``
references in command, args and env as the kubelet expands them), ConfigMap volumes written to files and
emptyDirs as directories. Each pod process gets its own empty ``/dev/shm`` (a memory emptyDir mounted
there sets its size), as every pod has in a cluster, so two pods can never meet through shared memory.
When a pod goes away, its process group is stopped (SIGTERM, then SIGKILL), as a container's processes
all end with it.

Images are not emulated: the command runs from ``bin_dir`` (this checkout's venv), except a container
whose command is ``vllm`` (the upstream vLLM-Omni image's entrypoint), which runs from the cached
vLLM-Omni CPU environment (``omnimodel_testbed.vllm_omni``) with the CPU platform plugin switched on.
Not emulated either: resource limits, probes (kwok reports readiness), restarts of crashed processes.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .kubeapi import KubeAPI
from .netns import POD_INTERFACE
from .shm import DEFAULT_SHM_SIZE, private_shm_argv
from .vllm_omni import VLLM_OMNI_CPU_ENV
from .vllm_omni import ensure_env as ensure_vllm_omni_env

__all__ = ["PodProcess", "PodRunner", "expand_env_refs", "is_vllm_omni", "shm_size"]

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
    name: str
    uid: str
    ip: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    argv: list[str] = field(default_factory=list)


class PodRunner:
    """Keeps one local process per running pod of ``namespace`` (optionally filtered by labels)."""

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
        self.running: dict[str, PodProcess] = {}
        self.started: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=f"podrunner-{self.namespace}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        with self._lock:
            pods = list(self.running.values())
            # Every pod told at once (they drain in parallel, as a node's pods do), then each awaited.
            for pod in pods:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pod.proc.pid, signal.SIGTERM)
            for pod in pods:
                self._terminate(pod)
                pod_address(pod.ip, add=False)
            self.running.clear()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync()
            except Exception:
                log.exception("pod runner sync failed")
            self._stop.wait(self.interval)

    # ----------------------------------------------------------------------------------------- sync
    def sync(self) -> None:
        pods = self.api.get(f"/api/v1/namespaces/{self.namespace}/pods").get("items", [])
        alive = {}
        for pod in pods:
            meta, status = pod["metadata"], pod.get("status") or {}
            if meta.get("deletionTimestamp") or status.get("phase") != "Running" or not status.get("podIP"):
                continue
            alive[meta["uid"]] = pod
        with self._lock:
            for uid, proc in list(self.running.items()):
                if uid not in alive:
                    self._terminate(proc)
                    pod_address(proc.ip, add=False)
                    del self.running[uid]
            for uid, pod in alive.items():
                if uid not in self.running:
                    self.running[uid] = self._launch(pod)
                    self.started.append(pod["metadata"]["name"])
                    if self.on_start is not None:
                        self.on_start(self.running[uid])

    def processes(self, name_prefix: str = "") -> list[PodProcess]:
        with self._lock:
            return [p for p in self.running.values() if p.name.startswith(name_prefix)]

    # --------------------------------------------------------------------------------------- launch
    def _secret_value(self, ref: Mapping[str, Any]) -> str:
        secret = self.api.get(f"/api/v1/namespaces/{self.namespace}/secrets/{ref['name']}")
        return base64.b64decode(secret["data"][ref["key"]]).decode()

    def _volumes(self, pod: Mapping[str, Any], root: Path) -> dict[str, Path]:
        """volume name → host directory holding its content."""
        out: dict[str, Path] = {}
        for volume in pod["spec"].get("volumes") or []:
            name = volume["name"]
            if name in self.shared_dirs:
                out[name] = self.shared_dirs[name]
                continue
            target = root / "volumes" / name
            target.mkdir(parents=True, exist_ok=True)
            sources = [volume] if "configMap" in volume else (volume.get("projected") or {}).get("sources") or []
            for source in sources:
                if "configMap" in source:
                    self._write_configmap(source["configMap"], target)
            out[name] = target
        return out

    def _write_configmap(self, ref: Mapping[str, Any], target: Path) -> None:
        """A configMap volume or projected source: every key as a file, or only ``items`` (key → path)."""
        cm = self.api.get(f"/api/v1/namespaces/{self.namespace}/configmaps/{ref['name']}")
        data = cm.get("data") or {}
        items = ref.get("items") or [{"key": k, "path": k} for k in data]
        for item in items:
            (target / item["path"]).write_text(data[item["key"]])

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

    def _launch(self, pod: Mapping[str, Any]) -> PodProcess:
        meta, spec = pod["metadata"], pod["spec"]
        ip = pod["status"]["podIP"]
        pod_address(ip, add=True)
        container = spec["containers"][0]
        root = self.workdir / meta["name"]
        root.mkdir(parents=True, exist_ok=True)
        volumes = self._volumes(pod, root)
        mounts = sorted(
            (
                (m["mountPath"], volumes[m["name"]])
                for m in container.get("volumeMounts") or []
                # /dev/shm is the pod's private tmpfs (below), not a host directory.
                if m["mountPath"] != "/dev/shm"
            ),
            key=lambda item: -len(item[0]),  # longest mount path first: /models/hf before /models
        )

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
            env[item["name"]] = host_path(value)

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
            # The vLLM-Omni env's own Python and tools, never this checkout's (its pins conflict).
            env.pop("PYTHONPATH", None)
            env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
            env.update(VLLM_OMNI_CPU_ENV)

        log_path = root / "container.log"
        with log_path.open("ab") as out:
            # Own session: the pod's processes form one group, stopped together (see _terminate).
            proc = subprocess.Popen(
                private_shm_argv(argv, shm_size(pod)),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=root,
                start_new_session=True,
            )
        log.info("started pod %s (%s) as pid %d: %s", meta["name"], ip, proc.pid, " ".join(argv))
        return PodProcess(meta["name"], meta["uid"], ip, proc, log_path, argv)

    @staticmethod
    def _terminate(pod: PodProcess) -> None:
        # The group is the session the pod's process leads (start_new_session): the process and every child
        # it left in it (engine cores, workers), and nothing else. A leader that already exited may leave
        # children behind, so the group is signalled even then.
        pgid = pod.proc.pid

        def signal_group(sig: signal.Signals) -> None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, sig)

        signal_group(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            pod.proc.wait(timeout=15)
        signal_group(signal.SIGKILL)
        if pod.proc.poll() is None:
            pod.proc.wait(timeout=5)
        log.info("stopped pod %s (pid %d, exit %s)", pod.name, pod.proc.pid, pod.proc.returncode)

    def cleanup(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)
