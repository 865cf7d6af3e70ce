"""Pins in e2e/cluster/go.mod and the cache key shared by build.sh and the harness."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from omnimodel_testbed import binaries

GO_MOD = binaries.go_module_dir() / "go.mod"
BUILD_SH = binaries.go_module_dir() / "build.sh"


def test_versions_are_pinned_consistently() -> None:
    v = binaries.pinned_versions()
    kube = re.fullmatch(r"v1\.(\d+)\.(\d+)", v["kubernetes"])
    assert kube is not None
    # Every staging module must be replaced by its published v0.<minor>.<patch> twin;
    # a mismatch builds a frankenstein apiserver or fails to compile.
    staging = f"v0.{kube.group(1)}.{kube.group(2)}"
    replaces = re.findall(r"^\s*(?:replace\s+)?(k8s\.io/[\w-]+) => (k8s\.io/[\w-]+) (v\S+)$", GO_MOD.read_text(), re.M)
    assert len(replaces) >= 33
    for old, new, version in replaces:
        assert old == new
        assert version == staging, old
    assert v["etcd"].startswith("v3.6.")


def test_cache_key_matches_build_script(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("OMNIMODEL_CACHE", str(tmp_path))
    v = {"kubernetes": "v1.36.5", "etcd": "v3.6.16", "kwok": "v0.8.0", "helm": "v3.21.4"}
    assert binaries.expected_dir(v) == tmp_path / "k8s-v1.36.5-etcd-v3.6.16-kwok-v0.8.0-helm-v3.21.4"
    # build.sh derives the same directory name; keep the two formats in lockstep.
    script = BUILD_SH.read_text()
    assert 'key="k8s-${kube_version}-etcd-${etcd_version}-kwok-${kwok_version}-helm-${helm_version}"' in script
    for stage in binaries.STAGES:
        assert stage in script
    for name in binaries.BINARIES:
        # The registry is a module of its own (e2e/cluster/registry), built by its own step.
        assert f"build {name} " in script or f'"${{registry_bin}}/{name}"' in script, name


def test_toolchain_env_override_must_be_complete(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("OMNIMODEL_TESTBED_TOOLCHAIN", str(tmp_path))
    with pytest.raises(binaries.BuildError, match="incomplete"):
        binaries.ensure_built()
    (tmp_path / "bin").mkdir()
    (tmp_path / "stages").mkdir()
    for name in binaries.BINARIES:
        exe = tmp_path / "bin" / name
        exe.write_text("#!/bin/sh\n")
        exe.chmod(0o755)
    for stage in binaries.STAGES:
        (tmp_path / "stages" / stage).write_text("kind: Stage\n")
    assert binaries.ensure_built().root == tmp_path


def test_a_quiet_build_says_what_is_compiling_and_about_how_long_is_left(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(binaries, "COLD_BUILD_SECONDS", {"etcd": 30, "kwok": 60, "helm": 90, "kwok-extra": 500})
    lines: list[str] = []
    progress = binaries._BuildProgress(heartbeat=3600, out=lines.append, pending=["kwok", "helm"])
    try:
        progress.line("[cluster-build] etcd: cached")
        assert progress.status() is None  # nothing compiling
        progress.line("[cluster-build] kwok: building sigs.k8s.io/kwok/cmd/kwok")
        status = progress.status()
        assert status is not None
        assert status.startswith("[cluster-build] kwok: still building (0s so far")
        assert "about 2 min 30 s left" in status  # kwok's 60 s + helm's 90 s; etcd is done, kwok-extra cached
        progress.line("[cluster-build] kwok: built in 58s")
        assert progress.status() is None
    finally:
        progress.stop()
    assert lines[0] == "[cluster-build] etcd: cached"  # every line of the build is passed on
