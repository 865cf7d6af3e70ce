"""OmniModel local test bed: a real Kubernetes control plane with fake accelerator nodes.

See DESIGN.md section 6. Typical use::

    from omnimodel_testbed import Cluster

    with Cluster() as state:          # starts (or reuses) the cluster
        print(state.kubeconfig)       # admin kubeconfig path

or from a shell: ``python -m omnimodel_testbed up|down|status|kubeconfig|helm-path|build``.
"""

from __future__ import annotations

from .binaries import BuildError, Toolchain, ensure_built
from .cluster import Cluster, ClusterError, ClusterState, default_state_dir
from .nodes import DEFAULT_FLEET, FakeNode, build_node, build_nodes

__all__ = [
    "DEFAULT_FLEET",
    "BuildError",
    "Cluster",
    "ClusterError",
    "ClusterState",
    "FakeNode",
    "Toolchain",
    "build_node",
    "build_nodes",
    "default_state_dir",
    "ensure_built",
]
