"""Run pods' containers as local processes: the part of a kubelet the serving e2e needs.

kwok makes pods Running and Ready without running anything. For tests that send real requests
through a gateway pod to stage pods, :class:`PodRunner` starts each pod's container command as a
process on this machine, bound to the pod's IP (inside the test bed's network namespace the pod CIDR
is local), with the pod's env, ConfigMap volumes written to files, emptyDirs as directories, and
Secret env resolved. When a pod goes away, its process is stopped by PID.

Not emulated: images (the command runs from ``bin_dir``, this checkout's venv), resource limits,
probes (kwok reports readiness), restarts of crashed processes.
"""

from __future__ import annotations

import base64
import logging
import os
import shutil
import subprocess
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .kubeapi import KubeAPI

__all__ = ["PodProcess", "PodRunner"]

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
    ) -> None:
        self.api = api
        self.namespace = namespace
        self.workdir = workdir
        self.bin_dir = bin_dir
        # volume name → host dir shared by every pod (e.g. the model cache, so a tiny model builds once)
        self.shared_dirs = dict(shared_dirs or {})
        self.extra_env = dict(extra_env or {})
        self.interval = interval
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
            for pod in list(self.running.values()):
                self._terminate(pod)
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
                    del self.running[uid]
            for uid, pod in alive.items():
                if uid not in self.running:
                    self.running[uid] = self._launch(pod)
                    self.started.append(pod["metadata"]["name"])

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
            if "configMap" in volume:
                cm_name = volume["configMap"]["name"]
                cm = self.api.get(f"/api/v1/namespaces/{self.namespace}/configmaps/{cm_name}")
                for key, value in (cm.get("data") or {}).items():
                    (target / key).write_text(value)
            out[name] = target
        return out

    def _launch(self, pod: Mapping[str, Any]) -> PodProcess:
        meta, spec = pod["metadata"], pod["spec"]
        ip = pod["status"]["podIP"]
        container = spec["containers"][0]
        root = self.workdir / meta["name"]
        root.mkdir(parents=True, exist_ok=True)
        volumes = self._volumes(pod, root)
        mounts = sorted(
            ((m["mountPath"], volumes[m["name"]]) for m in container.get("volumeMounts") or []),
            key=lambda item: -len(item[0]),  # longest mount path first: /models/hf before /models
        )

        def host_path(value: str) -> str:
            for mount_path, host in mounts:
                if value == mount_path or value.startswith(mount_path + "/"):
                    return str(host) + value[len(mount_path) :]
            return value

        argv = [*container.get("command", []), *container.get("args", [])]
        # The arguments are the container's and may name in-container paths; the executable is ours
        # (and may itself live under a path such as /tmp that a pod mounts over).
        exe = self.bin_dir / argv[0]
        args = [ip if a == "0.0.0.0" else host_path(a) for a in argv[1:]]
        argv = [str(exe) if exe.exists() else argv[0], *args]

        env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "PYTHONPATH")}
        for item in container.get("env") or []:
            if "value" in item:
                env[item["name"]] = host_path(item["value"])
            elif "secretKeyRef" in (item.get("valueFrom") or {}):
                env[item["name"]] = self._secret_value(item["valueFrom"]["secretKeyRef"])
        env.update(self.extra_env)

        log_path = root / "container.log"
        with log_path.open("ab") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=root)
        log.info("started pod %s (%s) as pid %d: %s", meta["name"], ip, proc.pid, " ".join(argv))
        return PodProcess(meta["name"], meta["uid"], ip, proc, log_path, argv)

    @staticmethod
    def _terminate(pod: PodProcess) -> None:
        if pod.proc.poll() is None:
            pod.proc.terminate()
            try:
                pod.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pod.proc.kill()
                pod.proc.wait(timeout=5)
        log.info("stopped pod %s (pid %d, exit %s)", pod.name, pod.proc.pid, pod.proc.returncode)

    def cleanup(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)
