"""pytest integration: a session-scoped ``cluster`` fixture.

Enable it from a conftest with ``pytest_plugins = ["omnimodel_testbed.pytest_plugin"]``.

Resolution order, so local iteration stays fast and CI stays hermetic:

1. ``OMNIMODEL_KUBECONFIG`` set: use that cluster as is; never start or stop anything.
2. A healthy cluster already recorded in the state dir (``make cluster-up``):
   reuse it and leave it running afterwards.
3. Otherwise start one for the session and stop it at the end.

With pytest-xdist, start the cluster before the run (case 1 or 2): workers
would otherwise share one cluster that the first worker to finish stops.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from .binaries import ensure_built, kubectl_binary
from .cluster import Cluster, ClusterState

__all__ = ["ClusterHandle", "cluster", "kubectl_binary", "session_cluster"]


@dataclass(frozen=True)
class ClusterHandle:
    """What a test needs to talk to the cluster."""

    kubeconfig: Path
    #: None when the cluster came from OMNIMODEL_KUBECONFIG (not ours).
    state: ClusterState | None
    started_here: bool

    @property
    def helm(self) -> Path:
        """helm built with the test bed (``helm --kubeconfig ...`` to target it)."""
        return self.state.helm if self.state is not None else ensure_built().path("helm")

    def kubectl(
        self, *args: str, check: bool = True, timeout: float = 60.0, stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl against this cluster (``stdin``: text on its standard input), capturing text output."""
        return subprocess.run(
            [kubectl_binary(), f"--kubeconfig={self.kubeconfig}", *args],
            input=stdin,
            capture_output=True,
            text=True,
            check=check,
            timeout=timeout,
        )


@contextmanager
def session_cluster(state_dir: Path | None = None) -> Iterator[ClusterHandle]:
    """Context manager implementing the resolution order in the module docstring."""
    external = os.environ.get("OMNIMODEL_KUBECONFIG")
    if external:
        yield ClusterHandle(Path(external), None, started_here=False)
        return
    c = Cluster(state_dir)
    state = c.up()
    try:
        yield ClusterHandle(state.kubeconfig, state, started_here=state.started_here)
    finally:
        if state.started_here:
            c.down()


@pytest.fixture(scope="session")
def cluster() -> Iterator[ClusterHandle]:
    """The local test-bed cluster for the whole session."""
    with session_cluster() as handle:
        yield handle
