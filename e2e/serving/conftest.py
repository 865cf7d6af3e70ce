"""Fixtures for real traffic through gateway and stage pods (run inside the test bed's netns).

`make e2e-serving` runs this directory as `python -m omnimodel_testbed netns -- pytest e2e/serving`: in
that network namespace the pod CIDR is local, so a process bound to a pod's IP is reachable at it, and
/etc/resolv.conf points at the test bed's cluster DNS, which these fixtures serve.
"""

from __future__ import annotations

import os
from collections.abc import Generator, Iterator
from functools import partial
from pathlib import Path

import pytest

from omnimodel_testbed import Cluster
from omnimodel_testbed.dns import ClusterDNS, service_addresses
from omnimodel_testbed.kubelet import PodRunner
from omnimodel_testbed.netns import CLUSTER_DNS, NETNS_POD_CIDR
from omnimodel_testbed.operator_pod import OperatorPod
from omnimodel_testbed.pytest_plugin import ClusterHandle
from support import Kube, cpu_pod_runner, pod_log_digest


@pytest.fixture(scope="session")
def cluster_dns(cluster: ClusterHandle) -> Iterator[ClusterDNS]:
    if os.environ.get("OMNIMODEL_TESTBED_POD_CIDR") != NETNS_POD_CIDR:
        pytest.fail("e2e/serving needs the test bed's network namespace: run `make e2e-serving`")
    assert cluster.state is not None
    api = Cluster().api(cluster.state)
    dns = ClusterDNS(partial(service_addresses, api), *CLUSTER_DNS)
    try:
        yield dns
    finally:
        dns.stop()


@pytest.fixture(scope="session")
def operator(
    cluster: ClusterHandle, cluster_dns: ClusterDNS, crd: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorPod]:
    """The operator as users run it: the chart installed with helm, its pod run from the operator image
    that ``make images`` pushed to the test bed's registry (the CRD is the session's, hence crds off)."""
    assert cluster.state is not None
    op = OperatorPod(
        cluster.state,
        Cluster().api(cluster.state),
        tmp_path_factory.mktemp("operator"),
        values=["--set=crds.enabled=false"],
    )
    op.install()
    try:
        op.wait_healthy()
        yield op
    finally:
        op.uninstall()


@pytest.fixture
def pods(cluster: ClusterHandle, cluster_dns: ClusterDNS, kube: Kube, tmp_path: Path) -> Iterator[PodRunner]:
    """Every pod of the test's namespace runs for real on the CPU, from its image (vLLM-Omni's from the
    cached vLLM-Omni environment: its upstream images cannot be pulled here)."""
    assert cluster.state is not None
    runner = cpu_pod_runner(Cluster().api(cluster.state), kube.ns, tmp_path / "pods", state=cluster.state)
    runner.start()
    try:
        yield runner
    finally:
        runner.stop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test shows its pods' trouble beside the traceback (before teardown stops them): a request
    that timed out through a gateway and three stage pods says nothing of which one dropped it, and CI
    keeps only the output."""
    report: pytest.TestReport = yield
    runner = getattr(item, "funcargs", {}).get("pods")
    if report.failed and isinstance(runner, PodRunner):
        report.sections.append(("pod logs", pod_log_digest(runner.workdir)))
    return report
