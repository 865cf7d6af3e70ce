"""The test bed's kubelet probes containers and runs their preStop hooks, as a kubelet does: a pod whose
readiness probe fails is not Ready and its Service's EndpointSlice says so (the real EndpointSlice
controller) until the probe passes; a liveness failure restarts the container; a deleted pod's preStop hook
runs before its SIGTERM, and the pod is removed once its container has stopped. (Break it by hand: a runner
that marks containers ready once started fails the first wait, and one that sends SIGTERM without the hook
fails the last assertion.)"""

from __future__ import annotations

import time
from typing import Any

import httpx

from omnimodel_testbed.kubelet import PodRunner
from omnimodel_testbed.pytest_plugin import ClusterHandle
from omnimodel_testbed.registry import RegistryImages
from support import Kube, wait_for

# Ready once told (POST /ready leaves a file in the pod's /tmp volume, which the exec readiness probe
# looks for: only inside the container is /tmp that volume); alive until told otherwise (POST /sick, this
# process only); GET /drain (the preStop hook) and SIGTERM each leave a line in the log.
_SERVER = r"""
import http.server, os, signal, sys
sick = False
def term(*_):
    print("TERM", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, term)
class H(http.server.BaseHTTPRequestHandler):
    def answer(self, code):
        self.send_response(code)
        self.send_header("Content-Length", "0")
        self.end_headers()
    def do_GET(self):
        if self.path == "/drain":
            print("drain", flush=True)
        self.answer(503 if self.path == "/livez" and sick else 200)
    def do_POST(self):
        global sick
        if self.path == "/ready":
            open("/tmp/ready", "w").close()
        sick = self.path == "/sick"
        self.answer(200)
    def log_message(self, *_):
        pass
print("up", flush=True)
http.server.HTTPServer((sys.argv[1], 8080), H).serve_forever()
"""


def _manifests(image: str) -> list[dict[str, Any]]:
    fast = {"periodSeconds": 1, "failureThreshold": 1}
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "web", "labels": {"app": "web"}},
        "spec": {
            "terminationGracePeriodSeconds": 30,
            "containers": [
                {
                    "name": "web",
                    "image": image,
                    "command": ["python", "-c", _SERVER, "0.0.0.0"],
                    "ports": [{"name": "http", "containerPort": 8080}],
                    # Nothing else is probed until it listens (else liveness would kill it while it starts).
                    "startupProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1, "failureThreshold": 120},
                    "readinessProbe": {
                        "exec": {
                            "command": ["python", "-c", "import os, sys; sys.exit(not os.path.exists('/tmp/ready'))"]
                        },
                        **fast,
                    },
                    "livenessProbe": {"httpGet": {"path": "/livez", "port": "http"}, **fast},
                    "lifecycle": {"preStop": {"httpGet": {"path": "/drain", "port": "http"}}},
                    "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
                }
            ],
            "volumes": [{"name": "tmp", "emptyDir": {}}],
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web"},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 8080, "targetPort": "http"}]},
    }
    return [service, pod]


def _endpoint_ready(kube: Kube) -> bool | None:
    """The pod's endpoint's ``ready`` in the Service's EndpointSlice (None while it has none)."""
    slices = kube.get("endpointslices", selector="kubernetes.io/service-name=web")["items"]
    endpoints = [e for s in slices for e in s.get("endpoints") or []]
    return bool(endpoints[0]["conditions"].get("ready")) if endpoints else None


def _events(kube: Kube) -> list[str]:
    return [f"{e['reason']}: {e['message']}" for e in kube.get("events")["items"]]


def test_probes_drive_readiness_and_restarts_and_prestop_runs_before_sigterm(
    cluster: ClusterHandle, kube: Kube, pods: PodRunner
) -> None:
    assert cluster.state is not None
    begin = time.monotonic()
    for manifest in _manifests(RegistryImages.of(cluster.state).runtime("cpu")):
        kube.apply(manifest)

    def status() -> dict[str, Any]:
        pod = kube.get("pod", "web") or {}
        statuses = (pod.get("status") or {}).get("containerStatuses") or [{}]
        return {"ip": (pod.get("status") or {}).get("podIP"), **statuses[0]}

    # Running, probed and failing: not Ready, and the EndpointSlice lists the pod as not ready.
    wait_for(lambda: any(e.startswith("Unhealthy: Readiness probe failed") for e in _events(kube)), 120)
    assert "running" in status()["state"] and not status()["ready"]
    assert wait_for(lambda: _endpoint_ready(kube) is False, 30, what="the pod's endpoint listed, not ready")
    ip = status()["ip"]
    httpx.post(f"http://{ip}:8080/ready", timeout=5).raise_for_status()
    wait_for(lambda: _endpoint_ready(kube), 30, what="the pod's endpoint ready once its probe passes")
    assert status()["ready"]

    # Liveness fails once (failureThreshold 1): killed, restarted at once, ready again.
    httpx.post(f"http://{ip}:8080/sick", timeout=5).raise_for_status()
    wait_for(lambda: status()["restartCount"] == 1 and status()["ready"], 30, what="restarted and ready again")
    assert status()["lastState"]["terminated"]["exitCode"] == 0  # the server exits on SIGTERM
    assert "Killing: Container web failed liveness probe, will be restarted" in _events(kube)

    # Deleted: the preStop hook reaches the server before its SIGTERM; once it has stopped the kubelet
    # removes the pod, long before its 30 s grace period is over.
    log = pods.workdir / "web" / "container.log"
    before = log.read_text()
    kube.run("delete", "pod", "web", "--wait=false")
    wait_for(lambda: kube.get("pod", "web") is None, 15, what="the deleted pod removed once stopped")
    assert log.read_text()[len(before) :].split() == ["drain", "TERM"]
    print(f"probes and preStop e2e: {time.monotonic() - begin:.1f}s")
