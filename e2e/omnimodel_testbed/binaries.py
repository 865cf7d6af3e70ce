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
import subprocess
import sys
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
)

#: kwok Stage documents build.sh copies out of the kwok module, in load order.
STAGES: tuple[str, ...] = (
    "node-initialize.yaml",
    "node-heartbeat-with-lease.yaml",
    "pod-ready.yaml",
    "pod-complete.yaml",
    "pod-delete.yaml",
)

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


def run_build_script() -> Toolchain:
    """Run build.sh unconditionally (it skips what exists); progress goes to stderr."""
    script = go_module_dir() / "build.sh"
    proc = subprocess.run(
        ["bash", str(script)],
        stdout=subprocess.PIPE,
        stderr=sys.stderr,
        text=True,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    if proc.returncode != 0 or not lines:
        raise BuildError(f"{script} failed with exit code {proc.returncode}")
    tc = Toolchain(Path(lines[-1]).parent)
    if not tc.complete():
        raise BuildError(f"{script} finished but {tc.root} is incomplete")
    return tc


def ensure_built() -> Toolchain:
    """Return a complete toolchain, building only when something is missing.

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
    return run_build_script()
