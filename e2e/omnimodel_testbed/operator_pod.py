"""The operator as a cluster runs it: ``helm install`` of the chart, and its pod run from the operator image.

A pod runner serves the release namespace before the chart is installed, so the Deployment's pod is
played by the test bed's kubelet: its image pulled from the test bed's registry (the chart names it
through its own values, ``RegistryImages.chart_values``), run as the image's uid 1000 with the chart's
read-only root filesystem, authenticated by the projected ServiceAccount token the API server's
admission mounted into it, and reaching the API server through the ``KUBERNETES_SERVICE_*`` variables the
kubelet sets (kube-proxy's ClusterIP routing is not emulated: they name the API server's own address).
"""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Final

from . import procs
from .cluster import ClusterState
from .images import ImageStore
from .kubeapi import KubeAPI, http_get
from .kubelet import PodProcess, PodRunner
from .registry import RegistryImages

__all__ = ["RELEASE", "RELEASE_NAMESPACE", "OperatorPod", "image_store", "service_env"]

log = logging.getLogger("omnimodel_testbed")

RELEASE: Final = "omnimodel-operator"
RELEASE_NAMESPACE: Final = "omnimodel-system"
REPO: Final = Path(__file__).resolve().parents[2]
CHART: Final = REPO / "charts" / "omnimodel-operator"


#: The operator pod's liveness and metrics ports. Not the chart's 8080 and 8081: the test bed's pods share
#: one network namespace, and Mooncake's master (beside vLLM-Omni's head) binds every address on 8080, which
#: a pod elsewhere holding 8080 on its own IP refuses (on a cluster each pod has a network namespace).
HEALTH_PORT: Final = 18080
METRICS_PORT: Final = 18081


def image_store(state: ClusterState) -> ImageStore:
    """The cluster's node image records (new with each cluster), over the shared unpacked-image cache."""
    return ImageStore(state.state_dir / "images" / "refs.json")


def service_env(state: ClusterState) -> dict[str, str]:
    """What the kubelet sets for the ``kubernetes`` Service: here the API server's own address."""
    port = str(state.ports["apiserver"])
    return {
        "KUBERNETES_SERVICE_HOST": "127.0.0.1",
        "KUBERNETES_SERVICE_PORT": port,
        "KUBERNETES_SERVICE_PORT_HTTPS": port,
    }


class OperatorPod:
    """The chart installed as ``RELEASE`` in ``RELEASE_NAMESPACE``, its operator pod run from its image."""

    def __init__(
        self,
        state: ClusterState,
        api: KubeAPI,
        workdir: Path,
        *,
        values: Sequence[str] = (),
        on_start: Callable[[PodProcess], None] | None = None,
        helm_env: Mapping[str, str] | None = None,
    ) -> None:
        self.state = state
        self.api = api
        self.images = RegistryImages.of(state)
        self.values = [
            *self.images.chart_values(),
            f"--set=operator.healthPort={HEALTH_PORT}",
            f"--set=metrics.port={METRICS_PORT}",
            *values,
        ]
        self.workdir = workdir
        self.runner = PodRunner(
            api,
            RELEASE_NAMESPACE,
            workdir / "pods",
            Path(sys.executable).parent,
            images=image_store(state),
            service_env=service_env(state),
            on_start=on_start,
        )
        self.helm_args: list[str] = []
        self.helm_env = dict(helm_env) if helm_env is not None else None

    def helm(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [str(self.state.helm), f"--kubeconfig={self.state.kubeconfig}", *args],
            capture_output=True,
            text=True,
            check=False,
            timeout=timeout,
            cwd=REPO,
            env=self.helm_env,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return proc

    def install(self) -> str:
        """Create the namespace, serve it, ``helm install``; returns helm's output. The pod starts pulling."""
        if self.api.raw("GET", f"/api/v1/namespaces/{RELEASE_NAMESPACE}")[0] == 404:
            self.api.create("/api/v1/namespaces", {"metadata": {"name": RELEASE_NAMESPACE}})
        self.runner.start()
        self.helm_args = ["install", RELEASE, str(CHART.relative_to(REPO)), "-n", RELEASE_NAMESPACE, *self.values]
        return self.helm(*self.helm_args).stdout

    def process(self) -> PodProcess | None:
        found = self.runner.processes(RELEASE)
        return found[0] if found else None

    def healthy(self) -> bool:
        """True once the operator pod's kopf answers /healthz on the pod's IP (it watches)."""
        process = self.process()
        if process is None:
            return False
        if process.proc.poll() is not None:
            tail = procs.log_tail(process.log_path, 40)
            raise RuntimeError(f"the operator pod's container exited with {process.proc.returncode}:\n{tail}")
        try:
            return http_get(process.ip, HEALTH_PORT, "/healthz", tls=False, timeout=1.0) == 200
        except OSError:
            return False

    def wait_healthy(self, timeout: float = 300) -> PodProcess:
        """Until /healthz answers (a first pull of the image included); returns the pod's process."""
        procs.wait_until("the operator pod's /healthz", self.healthy, timeout=timeout, interval=0.5)
        process = self.process()
        assert process is not None
        return process

    def uninstall(self) -> None:
        """``helm uninstall`` (the CRD stays: the chart keeps it), then the pod's process stops."""
        try:
            self.helm("uninstall", RELEASE, "-n", RELEASE_NAMESPACE, "--wait", "--timeout=60s", timeout=90)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            log.warning("%s", exc)
        finally:
            self.runner.stop()
