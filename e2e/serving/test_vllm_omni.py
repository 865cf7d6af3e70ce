"""Real vLLM-Omni in the test bed: a head pod and a headless replica pod of a tiny Qwen-Image, each with
its own /dev/shm, the replica finding the head through a headless Service's DNS name, requests through
the API Service with the official openai client, and both replicas serving.

The objects are written by hand (no operator yet): the pattern the operator's vLLM-Omni builders render.
"""

from __future__ import annotations

import base64
import re
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from omnimodel_runtime.tiny import ensure_tiny
from omnimodel_testbed.kubelet import PodProcess, PodRunner
from support import Kube, wait_for

pytestmark = pytest.mark.vllm_omni

MASTER_PORT = 15000
API_PORT = 8000
MODEL = "/models/tiny/text-to-image-v1-seed0"  # ensure_tiny's layout inside the shared model cache
# The head's own log names the replica each request went to, and the host each replica registered from.
ADD_REQUEST = re.compile(r"\[StageDiffusionClient\] stage-0 \[rep-(\d+)\] add request")
REGISTERED = re.compile(r"Stage 0 replica (\d+) registered from host (\S+)")


def deployment(name: str, component: str, args: list[str]) -> dict[str, Any]:
    labels = {"app.kubernetes.io/instance": "qimg", "app.kubernetes.io/component": component}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "nodeSelector": {"kubernetes.io/hostname": "cpu-0"},
                    "containers": [
                        {
                            "name": "vllm-omni",
                            "image": "vllm/vllm-omni:v0.30.0",
                            "command": ["vllm", "serve", MODEL, "--omni", "--dtype", "float32", *args],
                            "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
                            "volumeMounts": [{"name": "model-cache", "mountPath": "/models"}],
                        }
                    ],
                    "volumes": [{"name": "model-cache", "emptyDir": {}}],
                },
            },
        },
    }


def service(name: str, component: str, port: int, *, headless: bool) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "selector": {"app.kubernetes.io/instance": "qimg", "app.kubernetes.io/component": component},
        "ports": [{"name": "p", "port": port, "targetPort": port}],
    }
    if headless:
        spec["clusterIP"] = "None"
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name}, "spec": spec}


def log_text(pod: PodProcess) -> str:
    return pod.log_path.read_text(errors="replace")


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_head_and_headless_replica_both_serve_images(kube: Kube, pods: PodRunner) -> None:
    ensure_tiny("text-to-image", Path.home() / ".cache" / "omnimodel" / "models")
    master = f"qimg-master.{kube.ns}.svc"
    head_args = [
        "--stage-id", "0",
        "--omni-master-address", "$(POD_IP)",
        "--omni-master-port", str(MASTER_PORT),
        "--omni-lb-policy", "round-robin",
        "--host", "0.0.0.0",
        "--port", str(API_PORT),
    ]  # fmt: skip
    replica_args = ["--headless", "--stage-id", "0", "-oma", master, "-omp", str(MASTER_PORT), "-ora", "$(POD_IP)"]
    for doc in (
        service("qimg-master", "head", MASTER_PORT, headless=True),
        service("qimg", "head", API_PORT, headless=False),
        deployment("qimg-head", "head", head_args),
        deployment("qimg-stage-0", "replica", replica_args),
    ):
        kube.apply(doc)

    wait_for(lambda: pods.processes("qimg-head") and pods.processes("qimg-stage-0"), 60, what="both pods running")
    (head,) = pods.processes("qimg-head")
    (replica,) = pods.processes("qimg-stage-0")
    base = f"http://qimg.{kube.ns}.svc:{API_PORT}"

    def replica_attached() -> bool:
        assert head.proc.poll() is None, f"head exited:\n{log_text(head)[-3000:]}"
        assert replica.proc.poll() is None, f"replica exited:\n{log_text(replica)[-3000:]}"
        return "Remote diffusion replica attached stage=0 replica=1" in log_text(head)

    wait_for(replica_attached, 240, interval=1, what="the replica registered with the head and attached")
    wait_for(lambda: healthy(base), 60, interval=0.5, what="head /health 200 through the Service")
    registered = dict(REGISTERED.findall(log_text(head)))
    assert registered.get("1") == replica.ip, registered  # replica 1 is the other pod

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
    (model,) = [m.id for m in client.models.list().data]
    for i in range(4):
        image = client.images.generate(model=model, prompt=f"a cube {i}", size="64x64", response_format="b64_json")
        assert image.data
        assert base64.b64decode(image.data[0].b64_json or "").startswith(b"\x89PNG\r\n\x1a\n")
    served = [int(r) for r in ADD_REQUEST.findall(log_text(head))]
    assert sorted(served) == [0, 0, 1, 1], served  # round-robin over the head's replica and the remote one
