"""E2E fixtures: the local control plane (omnimodel_testbed), the CRD, and the real operator process."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from omnimodel_testbed.pytest_plugin import ClusterHandle
from support import Kube, Operator, install_crd


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).is_relative_to(Path(__file__).parent):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def crd(cluster: ClusterHandle) -> None:
    install_crd(cluster)


@pytest.fixture(scope="session")
def operator(cluster: ClusterHandle, crd: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operator]:
    op = Operator(cluster, tmp_path_factory.mktemp("operator"))
    op.start()
    try:
        yield op
    finally:
        op.stop()


@pytest.fixture
def kube(cluster: ClusterHandle, operator: Operator) -> Iterator[Kube]:
    """A fresh namespace per test, deleted afterwards (children go with it)."""
    ns = f"e2e-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", ns)
    k = Kube(cluster, ns)
    try:
        yield k
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        for volume in k.volumes:  # Retain: gone once its claim is (pv-protection)
            cluster.kubectl("delete", "pv", volume, "--wait=false", check=False)
