"""Cluster bookkeeping that needs no binaries: state round trip, config files, safe cleanup."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from omnimodel_testbed import Cluster, ClusterState, Toolchain
from omnimodel_testbed.binaries import STAGES
from omnimodel_testbed.pki import generate_pki
from omnimodel_testbed.procs import ProcessRecord


def test_state_round_trip(tmp_path: Path) -> None:
    st = ClusterState(
        state_dir=tmp_path,
        kubeconfig=tmp_path / "admin.kubeconfig",
        server="https://127.0.0.1:6443",
        ports={"apiserver": 6443},
        processes=[ProcessRecord("etcd", 1234, 99, "/x/etcd", "/x/etcd.log")],
        toolchain=tmp_path / "tc",
        nodes=["h200-0"],
        started_at=1.0,
        ready_seconds=12.5,
    )
    assert ClusterState.from_json(st.to_json()) == st
    assert st.helm == tmp_path / "tc" / "bin" / "helm"


def test_no_state_means_not_up(tmp_path: Path) -> None:
    c = Cluster(tmp_path)
    assert c.load_state() is None
    assert not c.healthy()
    assert c.status()["up"] is False
    assert c.down() == []


def test_kubeconfig_is_self_contained(tmp_path: Path) -> None:
    c = Cluster(tmp_path)
    pki = generate_pki(tmp_path / "pki", service_ip="10.96.0.1")
    c._write_kubeconfig("https://127.0.0.1:1234", pki)
    cfg = yaml.safe_load(c.kubeconfig.read_text())
    assert cfg["clusters"][0]["cluster"]["server"] == "https://127.0.0.1:1234"
    assert "certificate-authority-data" in cfg["clusters"][0]["cluster"]
    assert set(cfg["users"][0]["user"]) == {"client-certificate-data", "client-key-data"}


def test_kwok_config_carries_every_stage(tmp_path: Path) -> None:
    tc = Toolchain(tmp_path / "tc")
    tc.stages_dir.mkdir(parents=True)
    for s in STAGES:
        (tc.stages_dir / s).write_text(f"apiVersion: kwok.x-k8s.io/v1alpha1\nkind: Stage\nmetadata:\n  name: {s}\n")
    path = Cluster(tmp_path)._write_kwok_config(tmp_path, tc)
    docs = list(yaml.safe_load_all(path.read_text()))
    assert docs[0]["kind"] == "KwokConfiguration"
    assert docs[0]["options"]["cidr"].startswith("127.")
    # kwok's own stages, then the one that leaves a pod runner's pods to it (runnerpods.py)
    assert [d["metadata"]["name"] for d in docs[1:]] == [*STAGES, "pod-runner-create", "pod-runner-delete"]


@pytest.mark.parametrize("victim", ["etcd-data", "logs", "state.json"])
def test_reset_only_removes_what_the_harness_owns(tmp_path: Path, victim: str) -> None:
    keep = tmp_path / "notes.txt"
    keep.write_text("mine")
    target = tmp_path / victim
    if "." in victim:
        target.write_text("{}")
    else:
        target.mkdir()
        (target / "f").write_text("x")
    Cluster(tmp_path)._reset_dir()
    assert not target.exists()
    assert keep.read_text() == "mine"
