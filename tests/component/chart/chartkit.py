"""Helpers for the chart and image tests: locate helm, run it, pick manifests out of its output."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[3]
CHART = REPO / "charts" / "omnimodel-operator"
KUBE_VERSION = "1.36.0"
RELEASE = "omni"
NAMESPACE = "omnimodel-system"

Manifest = dict[str, Any]
Render = Callable[..., list[Manifest]]
RenderError = Callable[[Mapping[str, Any]], str]


def find_helm() -> str | None:
    """$HELM, else the helm the test bed built (never builds it here), else helm on PATH."""
    if os.environ.get("HELM"):
        return os.environ["HELM"]
    try:
        from omnimodel_testbed.binaries import BuildError, Toolchain, expected_dir

        toolchain_env = os.environ.get("OMNIMODEL_TESTBED_TOOLCHAIN")
        toolchain = Toolchain(Path(toolchain_env)) if toolchain_env else Toolchain(expected_dir())
        candidate = toolchain.path("helm")
        if os.access(candidate, os.X_OK):
            return str(candidate)
    except (ImportError, BuildError, OSError):
        pass
    return shutil.which("helm")


def run_helm(helm: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    # No kubeconfig: template and lint must never reach a cluster.
    home = Path(os.environ.get("TMPDIR", "/tmp")) / "omnimodel-chart-tests-helm"
    env = {
        **os.environ,
        "KUBECONFIG": os.devnull,
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
    }
    proc = subprocess.run([helm, *args], capture_output=True, text=True, check=False, timeout=120, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
    return proc


def template_args(values: Mapping[str, Any] | None, tmp: Path) -> list[str]:
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION]
    if values:
        path = tmp / f"values-{len(list(tmp.iterdir()))}.yaml"
        path.write_text(yaml.safe_dump(dict(values)))
        args += ["--values", str(path)]
    return args


def find(manifests: list[Manifest], kind: str, name: str | None = None, namespace: str | None = None) -> Manifest:
    matches = [
        m
        for m in manifests
        if m["kind"] == kind
        and (name is None or m["metadata"]["name"] == name)
        and (namespace is None or m["metadata"].get("namespace") == namespace)
    ]
    assert len(matches) == 1, f"expected one {kind} {name or ''}, found {len(matches)}"
    return matches[0]


def kinds(manifests: list[Manifest]) -> list[str]:
    return sorted(m["kind"] for m in manifests)


def operator_container(manifests: list[Manifest]) -> dict[str, Any]:
    deployment = find(manifests, "Deployment")
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["operator"]
    container: dict[str, Any] = containers[0]
    return container


def env_of(container: Mapping[str, Any]) -> dict[str, str]:
    """Plain ``value`` env entries (valueFrom ones are left out)."""
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
