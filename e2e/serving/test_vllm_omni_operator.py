"""OmniModels on vLLM-Omni's own engines, rendered by the operator and run for real: every pod a process
of the cached vLLM-Omni CPU environment on its pod IP, with its own /dev/shm, so a same-host
shared-memory shortcut cannot pass. Requests go through the API Service with the official openai client.

Timings on 2 cores (tiny models, CPU): the image graph is up in about a minute, the three-pod
Qwen2.5-Omni graph in about two; a lost replica is recovered (head and replicas restarted together by
the operator) within RECOVERY_BOUND; a stalled talker is detached about 30 s after it stops, and a new
head serves audio again about two minutes after it starts.
"""

from __future__ import annotations

import base64
import io
import os
import re
import signal
import subprocess
import threading
import time
import wave
from pathlib import Path
from typing import Any

import openai
import pytest

from omnimodel_runtime.tiny import ensure_tiny
from omnimodel_testbed.kubelet import PodProcess, PodRunner
from support import Kube, healthy, wait_for

pytestmark = pytest.mark.vllm_omni

MODELS = Path.home() / ".cache" / "omnimodel" / "models"
CPU_ARGS = ["--dtype", "float32"]
# How long the graph may take to serve again after a replica pod is killed: the operator restarts the
# head (vLLM-Omni 0.30.0's head can wedge when a replica dies) and then every replica, which reload.
RECOVERY_BOUND = 300.0
ADD_REQUEST = re.compile(r"\[StageDiffusionClient\] stage-0 \[rep-(\d+)\] add request")


def log_text(pod: PodProcess) -> str:
    return pod.log_path.read_text(errors="replace")


def heads(pods: PodRunner) -> list[PodProcess]:
    return [p for p in pods.processes("qimg-dit-") if not p.name.startswith("qimg-dit-replicas-")]


def omnimodel(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "omnimodel.io/v1alpha1", "kind": "OmniModel", "metadata": {"name": name}, "spec": spec}


def run_liveness_probe(kube: Kube, instance: str, pod: PodProcess) -> subprocess.CompletedProcess[str]:
    """The pod's liveness probe, as rendered (exec), run as the kubelet would: the container's env, its
    timeout. The test bed runs no probes itself, and binds a pod's ports to the pod's IP, not to a
    loopback of its own: the probe's 127.0.0.1 (the pod's own loopback in a cluster) becomes that IP."""
    (spec,) = [p for p in kube.pods(f"app.kubernetes.io/instance={instance}") if p["metadata"]["name"] == pod.name]
    (container,) = spec["spec"]["containers"]
    probe = container["livenessProbe"]
    env = {**os.environ, **{e["name"]: e["value"] for e in container.get("env") or [] if "value" in e}}
    command = [arg.replace("127.0.0.1", pod.ip) for arg in probe["exec"]["command"]]
    return subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=probe["timeoutSeconds"], check=False
    )


def spoken_wav(client: openai.OpenAI, model: str) -> tuple[int, int, int]:
    """A text + audio chat's WAV: (channels, frame rate, frames)."""
    spoken = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hello"}], extra_body={"modalities": ["text", "audio"]}
    )
    audio = next((c.message.audio for c in spoken.choices if c.message.audio), None)
    assert audio is not None, spoken
    with wave.open(io.BytesIO(base64.b64decode(audio.data))) as wav:
        return wav.getnchannels(), wav.getframerate(), wav.getnframes()


def png(client: openai.OpenAI, model: str, prompt: str) -> bytes:
    image = client.images.generate(model=model, prompt=prompt, size="64x64", response_format="b64_json")
    return base64.b64decode(image.data[0].b64_json or "") if image.data else b""


def test_an_image_stage_with_two_replicas_serves_from_both_and_recovers_a_lost_replica(
    kube: Kube, pods: PodRunner
) -> None:
    model_dir = ensure_tiny("text-to-image", MODELS)
    kube.apply(
        omnimodel(
            "qimg",
            {
                "model": {"source": f"file:///models/tiny/{model_dir.name}", "servedName": "qwen-image"},
                # Round-robin (vLLM-Omni's default picks at random), so four requests split two and two.
                "runtime": {"kind": "vllm-omni", "extraArgs": [*CPU_ARGS, "--omni-lb-policy", "round-robin"]},
                "stages": [{"name": "dit", "replicas": 2, "accelerator": {"vendor": "cpu"}}],
            },
        )
    )
    kube.wait_ready("qimg")  # the Deployments; the processes themselves answer below
    base = f"http://qimg-gateway.{kube.ns}.svc:8000"
    wait_for(lambda: healthy(base), 300, interval=1, what="the head's /health through the API Service")
    (head,) = heads(pods)
    (replica,) = pods.processes("qimg-dit-replicas-")
    wait_for(lambda: "replica attached stage=0 replica=1" in log_text(head), 120, what="the replica attached")

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == ["qwen-image"]
    for i in range(4):
        assert png(client, "qwen-image", f"a cube {i}").startswith(b"\x89PNG\r\n\x1a\n")
    served = sorted(int(r) for r in ADD_REQUEST.findall(log_text(head)))
    # Both the head's own replica and the replica pod's serve. Not an exact two and two: vLLM-Omni 0.30's
    # round-robin counts from where its cursor stands (a CI run saw three and one).
    assert len(served) == 4 and set(served) == {0, 1}, served

    # Kill the replica pod under steady traffic: no request hangs, and the graph serves again (the
    # operator restarts the head, then the replicas, which register with it) within the bound.
    results: list[tuple[float, float, bool]] = []  # (started, seconds, ok)
    stop = threading.Event()

    def traffic() -> None:
        while not stop.is_set():
            started = time.monotonic()
            try:
                ok = png(client, "qwen-image", "under traffic").startswith(b"\x89PNG")
            except openai.APIError:
                ok = False
            results.append((started, time.monotonic() - started, ok))
            if not ok:
                stop.wait(1)

    thread = threading.Thread(target=traffic, daemon=True)
    thread.start()
    wait_for(lambda: len(results) >= 3, 30, what="traffic flowing")
    kube.run("delete", "pod", replica.name, "--wait=false")
    killed = time.monotonic()

    def recovered() -> PodProcess | None:
        new = [p for p in heads(pods) if p.uid != head.uid]
        if not new or "replica attached stage=0 replica=1" not in log_text(new[0]):
            return None
        return new[0] if any(start > killed and ok for start, _, ok in results[-3:]) else None

    new_head: PodProcess = wait_for(recovered, RECOVERY_BOUND, interval=2, what="a new head with a replica, serving")
    recovery = time.monotonic() - killed
    stop.set()
    thread.join(timeout=90)
    assert not thread.is_alive(), "a request hung"
    assert max(seconds for _, seconds, _ in results) < 60, "a request ran into the client timeout"
    failed = sum(1 for start, _, ok in results if start > killed and not ok)
    for i in range(4):
        assert png(client, "qwen-image", f"after {i}").startswith(b"\x89PNG\r\n\x1a\n")
    served = sorted(int(r) for r in ADD_REQUEST.findall(log_text(new_head)))
    assert {0, 1} <= set(served), served  # both replicas serve again
    print(f"replica killed: serving again after {recovery:.0f}s; {failed} request(s) failed meanwhile, none hung")


# Its own waits allow 420 s for the three engines to register, twice (118 s measured alone; more under
# load): pytest-timeout's default 300 s must not cut them short.
@pytest.mark.timeout(1200)
def test_qwen_omni_in_three_pods_on_three_vendors_answers_text_and_audio_and_outlives_a_stalled_talker(
    kube: Kube, pods: PodRunner
) -> None:
    model_dir = ensure_tiny("qwen2.5-omni-vllm-omni", MODELS)
    small = {"max_num_batched_tokens": 4096, "max_model_len": 4096, "max_num_seqs": 1, "enforce_eager": True}
    kube.apply(
        omnimodel(
            "omni",
            {
                "model": {"source": f"file:///models/tiny/{model_dir.name}", "servedName": "qwen-omni"},
                "runtime": {"kind": "vllm-omni", "deployConfig": "qwen2_5_omni", "extraArgs": CPU_ARGS},
                "stages": [
                    {"name": "thinker", "accelerator": {"vendor": "nvidia", "product": "H200", "count": 1},
                     "engineArgs": {**small, "default_sampling_params": {"max_tokens": 16}}},
                    # The tiny talker never emits its stop code: cap it, or audio takes minutes on CPU.
                    {"name": "talker", "accelerator": {"vendor": "amd", "product": "MI300X", "count": 1},
                     "engineArgs": {**small, "default_sampling_params": {"max_tokens": 24}}},
                    {"name": "code2wav", "accelerator": {"vendor": "ascend", "product": "910B", "count": 1},
                     "engineArgs": small},
                ],
            },
        )
    )  # fmt: skip
    kube.wait_ready("omni")
    nodes = {
        p["metadata"]["labels"]["omnimodel.io/stage"]: p["spec"]["nodeName"]
        for p in kube.pods("app.kubernetes.io/instance=omni")
        if "omnimodel.io/stage" in p["metadata"]["labels"]
    }
    assert (
        nodes["thinker"].startswith("h200-") and nodes["talker"] == "mi300x-0" and nodes["code2wav"] == "ascend910b-0"
    )
    base = f"http://omni-gateway.{kube.ns}.svc:8000"
    wait_for(lambda: healthy(base), 420, interval=2, what="the head's /health (every stage registered)")

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
    text = client.chat.completions.create(
        model="qwen-omni", messages=[{"role": "user", "content": "hello"}], extra_body={"modalities": ["text"]}
    )
    assert text.choices[0].message.content
    channels, rate, frames = spoken_wav(client, "qwen-omni")
    assert (channels, rate) == (1, 24000) and frames > 0

    # A talker that stalls past its 30 s heartbeat timeout (a hung device, a throttled node) is detached
    # by the head and never taken back, even once it resumes: every audio request then fails with 500
    # "Stage-1 has no live replica", while text still answers. /health turns 503, so the head's liveness
    # probe fails, and a new head process (the kubelet's restart) brings new replicas (restarts.py).
    (head,) = pods.processes("omni-thinker-")
    passed = run_liveness_probe(kube, "omni", head)
    assert passed.returncode == 0, passed.stderr
    (talker,) = pods.processes("omni-talker-")
    os.killpg(talker.proc.pid, signal.SIGSTOP)
    stalled = time.monotonic()
    try:
        wait_for(lambda: "detached replica stage=1" in log_text(head), 120, what="the head detached the stalled talker")
    finally:
        os.killpg(talker.proc.pid, signal.SIGCONT)
    detached = time.monotonic() - stalled
    wait_for(lambda: not healthy(base), 30, what="/health 503 without a live talker")
    failed = run_liveness_probe(kube, "omni", head)
    assert failed.returncode != 0 and "503" in failed.stderr, failed
    # The test bed restarts no container on a failed probe: deleting the head's pod gives the same new
    # head process, whose replicas the operator then restarts.
    kube.run("delete", "pod", head.name, "--wait=false")
    restarted = time.monotonic()
    wait_for(
        lambda: any(p.uid != head.uid for p in pods.processes("omni-thinker-")) and healthy(base),
        420,
        interval=2,
        what="a new head with every stage registered",
    )
    # The stalled talker was replaced (its Deployment rolled), not taken back.
    wait_for(lambda: talker.uid not in {p.uid for p in pods.processes("omni-talker-")}, 60, what="the old talker gone")
    channels, rate, frames = spoken_wav(client, "qwen-omni")
    assert (channels, rate) == (1, 24000) and frames > 0
    served = time.monotonic() - restarted
    print(f"talker stalled: detached after {detached:.0f}s; a new head served audio {served:.0f}s after")
