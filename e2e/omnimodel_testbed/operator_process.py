"""The operator of an installed chart, run here as a local process with its ServiceAccount's token.

No container engine runs the operator pod (kwok only fakes its lifecycle), so the operator runs as a
local process with exactly the pod's command and environment, taken from the installed Deployment,
authenticated with a token of the chart's ServiceAccount (TokenRequest API): every API call it makes
goes through the chart's RBAC. Only the liveness and metrics ports move to free loopback ports, since
every operator process on this host would otherwise share them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from . import procs
from .kubeapi import http_get

__all__ = ["ChartOperator", "service_account_kubeconfig"]


def service_account_kubeconfig(admin_kubeconfig: Path, token: str, path: Path) -> Path:
    """A kubeconfig for the cluster of ``admin_kubeconfig`` that authenticates with ``token`` only."""
    admin = yaml.safe_load(Path(admin_kubeconfig).read_text())
    context = next(c for c in admin["contexts"] if c["name"] == admin["current-context"])["context"]
    cluster = next(c for c in admin["clusters"] if c["name"] == context["cluster"])["cluster"]
    ca = cluster.get("certificate-authority")
    if ca and not Path(ca).is_absolute():
        cluster = {**cluster, "certificate-authority": str(Path(admin_kubeconfig).parent / ca)}
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "testbed", "cluster": cluster}],
                "users": [{"name": "operator", "user": {"token": token}}],
                "contexts": [{"name": "operator", "context": {"cluster": "testbed", "user": "operator"}}],
                "current-context": "operator",
            }
        )
    )
    path.chmod(0o600)
    return path


class ChartOperator:
    """The operator container of an installed Deployment, run as a process (stopped by PID).

    ``own_session``: start it in a session of its own, so a Ctrl-C at the terminal reaches only the
    program that started it, which stops it in order (and a record of its PID can stop its group).
    """

    def __init__(
        self,
        deployment: Mapping[str, Any],
        kubeconfig: Path,
        workdir: Path,
        *,
        bin_dir: Path | None = None,
        own_session: bool = False,
    ) -> None:
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        self.port = procs.free_port()
        command = [*container["command"], *container["args"]]
        # Same program from this venv; the liveness endpoint moves to a free loopback port.
        command[0] = str((bin_dir or Path(sys.executable).parent) / command[0])
        command = [
            f"--liveness=http://127.0.0.1:{self.port}/healthz" if a.startswith("--liveness=") else a for a in command
        ]
        # valueFrom entries (POD_ID, kopf's peering identity) are the pod's own: kopf names a process itself.
        env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
        env["OMNIMODEL_HEALTH_PORT"] = str(self.port)
        # The pod's metrics port would be shared by every operator process on this host.
        self.metrics_port = procs.free_port()
        env["OMNIMODEL_METRICS_PORT"] = str(self.metrics_port)
        self.env = env
        self.command = command
        workdir.mkdir(parents=True, exist_ok=True)
        self.log = workdir / "operator.log"
        base = {k: v for k, v in os.environ.items() if not k.startswith("OMNIMODEL_")}
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**base, **env, "KUBECONFIG": str(kubeconfig)},
                start_new_session=own_session,
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def healthy(self) -> bool:
        """True once kopf answers /healthz; raises RuntimeError (with its log) if the process exited."""
        if self.proc.poll() is not None:
            tail = self.log.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"operator exited with {self.proc.returncode}; {self.log}:\n{tail}")
        try:
            return http_get("127.0.0.1", self.port, "/healthz", tls=False, timeout=1.0) == 200
        except OSError:
            return False

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 20 s."""
        procs.terminate(self.proc, grace=20)
