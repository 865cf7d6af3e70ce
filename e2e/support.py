"""Helpers for the e2e suites: polling, the operator process, kubectl scoped to a namespace."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml

from omnimodel_testbed import procs
from omnimodel_testbed.cluster import ClusterState
from omnimodel_testbed.kubeapi import KubeAPI
from omnimodel_testbed.kubelet import PodRunner
from omnimodel_testbed.operator_pod import image_store, service_env
from omnimodel_testbed.pytest_plugin import ClusterHandle
from omnimodel_testbed.registry import RegistryImages
from omnimodel_testbed.volumes import claim_volume

REPO = Path(__file__).parents[1]
CRD = REPO / "crds" / "omnimodel.io_omnimodels.yaml"


def install_crd(cluster: ClusterHandle) -> None:
    """Apply the committed CRD and wait until the API server serves it."""
    cluster.kubectl("apply", "--server-side", "-f", str(CRD))

    # Polled rather than `kubectl wait`, which fails at once while the new CRD has no status yet
    # (".status.conditions accessor error: <nil>"), as it did now and then.
    def established() -> bool:
        crd = json.loads(cluster.kubectl("get", "crd/omnimodels.omnimodel.io", "-o", "json").stdout)
        conditions = (crd.get("status") or {}).get("conditions") or []
        return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)

    wait_for(established, 60, what="the OmniModel CRD Established")


def cpu_pod_runner(api: KubeAPI, namespace: str, workdir: Path, *, state: ClusterState | None) -> PodRunner:
    """A pod runner that runs every pod of ``namespace`` for real on this machine's CPU (not started yet):
    from its image, pulled from the test bed's registry of ``state``'s cluster, or with ``state`` None
    from this checkout's venv (a benchmark of the operator against a host-run operator)."""
    return PodRunner(
        api,
        namespace,
        workdir,
        Path(sys.executable).parent,
        images=image_store(state) if state is not None else None,
        service_env=service_env(state) if state is not None else None,
        # One model cache for all pods, as a shared PVC would be: the tiny model is built once.
        shared_dirs={"model-cache": Path.home() / ".cache" / "omnimodel" / "models"},
        extra_env={
            # The fake nodes have no devices: every stage runs on this machine's CPU, whatever vendor the
            # scheduler placed it on (as `make demo` does).
            "OMNIMODEL_DEVICE": "cpu",
            "CUDA_VISIBLE_DEVICES": "",
            # Two cores for many processes: one torch thread each avoids thrashing.
            "OMP_NUM_THREADS": "1",
            "OMNIMODEL_HEALTH_INTERVAL": "0.5",
        },
    )


# What a pod log line says went wrong, vLLM-Omni's membership events included (a replica that misses its
# heartbeats for 30 s is detached from the head); vLLM colours its level names, so the codes go first.
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_TROUBLE = re.compile(
    r"error|warning|traceback|timeout|timed out|heartbeat|detach|unregister|disappeared", re.IGNORECASE
)


def pod_log_digest(workdir: Path, *, trouble: int = 30, last: int = 12) -> str:
    """Every pod log under a pod runner's ``workdir``: its last ``trouble`` lines that name an error,
    warning or timeout, then its last ``last`` lines. A request that times out through several pods says
    nothing of where it stopped; this is what a failed e2e test shows beside its traceback."""
    out: list[str] = []
    for log in sorted(workdir.glob("*/*.log")):
        lines = [_ANSI.sub("", ln) for ln in log.read_text(errors="replace").splitlines()]
        out.append(f"==> {log.parent.name}/{log.name} ({len(lines)} lines)")
        if not lines:
            continue
        flagged = [ln for ln in lines if _TROUBLE.search(ln)][-trouble:]
        if flagged:
            out += ["-- errors, warnings, timeouts:", *flagged]
        out += [f"-- last {min(last, len(lines))} lines:", *lines[-last:]]
    return "\n".join(out) or f"no pod logs under {workdir}"


def example(name: str) -> dict[str, Any]:
    """One of ``examples/`` as a dict."""
    doc: dict[str, Any] = yaml.safe_load((REPO / "examples" / name).read_text())
    return doc


def healthy(url: str) -> bool:
    """``url``'s /health answers 200."""
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def stage_requests(url: str) -> float:
    """Finished requests a stage process has served, from its own /metrics."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith("omnimodel_stage_requests_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_for(predicate: Callable[[], Any], timeout: float = 60.0, interval: float = 0.25, what: str = "") -> Any:
    """Poll until ``predicate`` returns something truthy; fail with ``what`` after ``timeout``."""
    return procs.poll(predicate, timeout=timeout, what=what or repr(predicate), interval=interval)


class Operator:
    """`omnimodel-operator run` as a subprocess against the test cluster; stopped by PID."""

    def __init__(self, cluster: ClusterHandle, log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.cluster = cluster
        # The settings users get, unless a test says otherwise and why: status truth and drift repair
        # must hold under the shipped resync interval, not a friendlier one.
        self.extra_env = dict(env or {})
        self.log_dir = log_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.metrics_port = 0

    def start(self) -> None:
        self.starts += 1
        port = procs.free_port()
        # Its own free port, not the default 8081: another operator (test_chart's) may run meanwhile.
        self.metrics_port = procs.free_port()
        log_path = self.log_dir / f"operator-{self.starts}.log"
        env = {
            **os.environ,
            "KUBECONFIG": str(self.cluster.kubeconfig),
            "OMNIMODEL_METRICS_PORT": str(self.metrics_port),
            **self.extra_env,
        }
        state = self.cluster.state
        if state is not None and "registry" in state.ports and "OMNIMODEL_RUNTIME_IMAGES" not in env:
            # What the chart sets in the test bed: every vendor's stage image is the CPU one of the test bed's
            # registry (the fake nodes have no devices; Ascend and Intel have no image of their own).
            env["OMNIMODEL_RUNTIME_IMAGES"] = json.dumps(RegistryImages.of(state).runtime_images())
        with log_path.open("wb") as log:  # Popen dups the descriptor; ours closes here
            self.proc = subprocess.Popen(
                [
                    str(Path(sys.executable).parent / "omnimodel-operator"),
                    "run",
                    "--liveness",
                    f"http://127.0.0.1:{port}/healthz",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )

        def alive() -> bool:
            assert self.proc is not None and self.proc.poll() is None, f"operator exited, see {log_path}"
            try:
                return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(alive, 60, what="operator liveness endpoint")

    def scrape(self) -> str:
        """The operator's /metrics text (served from its startup handler, up before /healthz answers)."""
        response = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5)
        response.raise_for_status()
        return response.text

    def kill(self) -> None:
        """SIGKILL: no cleanup handlers run, as when a pod is evicted mid-reconcile."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None:
            procs.terminate(self.proc, grace=20)


class Kube:
    """kubectl scoped to one test namespace, with JSON helpers."""

    def __init__(self, cluster: ClusterHandle, namespace: str) -> None:
        self.cluster = cluster
        self.ns = namespace
        self.volumes: list[str] = []  # cluster-scoped: deleted by the fixture, not with the namespace

    def run(self, *args: str, check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return self.cluster.kubectl(*args, "-n", self.ns, check=check, stdin=stdin)

    def apply(self, manifest: dict[str, Any] | str, check: bool = True) -> subprocess.CompletedProcess[str]:
        text = manifest if isinstance(manifest, str) else json.dumps(manifest)
        return self.run("apply", "-f", "-", check=check, stdin=text)

    def get(self, kind: str, name: str | None = None, selector: str | None = None) -> Any:
        args = ["get", kind, *([name] if name else []), "-o", "json"]
        if selector:
            args += ["-l", selector]
        result = self.run(*args, check=False)
        if result.returncode != 0:
            if "NotFound" in result.stderr:
                return None
            raise AssertionError(result.stderr)
        return json.loads(result.stdout)

    def condition(self, name: str, type_: str = "Ready") -> dict[str, Any] | None:
        obj = self.get("omnimodel", name)
        for c in ((obj or {}).get("status") or {}).get("conditions") or []:
            if c["type"] == type_:
                return dict(c)
        return None

    def wait_ready(self, name: str, timeout: float = 90) -> dict[str, Any]:
        def ready() -> dict[str, Any] | None:
            c = self.condition(name)
            obj = self.get("omnimodel", name)
            gen = (obj or {}).get("metadata", {}).get("generation")
            if c and c["status"] == "True" and c.get("observedGeneration") == gen:
                return c
            return None

        result: dict[str, Any] = wait_for(ready, timeout, what=f"{name} Ready=True")
        return result

    def bind_claim(self, name: str, host_path: Path, timeout: float = 30) -> str:
        """Be the static storage administrator the test bed lacks: once claim ``name`` exists, create
        a hostPath volume reserved for it (the real PV controller binds them); return the volume's
        name. The fixture deletes the volumes of its namespace afterwards."""
        claim = wait_for(lambda: self.get("pvc", name), timeout, what=f"PersistentVolumeClaim {name}")
        volume = claim_volume(claim, host_path)
        self.apply(volume)  # cluster-scoped: kubectl ignores the namespace
        self.volumes.append(volume["metadata"]["name"])
        return str(volume["metadata"]["name"])

    def pods(self, selector: str) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self.get("pods", selector=selector)["items"]
        return items

    def node(self, name: str) -> dict[str, Any]:
        node: dict[str, Any] = json.loads(self.cluster.kubectl("get", "node", name, "-o", "json").stdout)
        return node
