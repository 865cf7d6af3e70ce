"""Qwen3-Omni (vLLM-Omni's ``qwen3_omni_moe`` config) rendered by the operator and run for real: the
thinker in the head pod on an nvidia node, two talker replicas on an amd node, code2wav on an ascend node,
every pod a process of the cached vLLM-Omni CPU environment on its own pod IP with its own /dev/shm. The
config streams chunks between stages (``async_chunk``); the operator carries both edges over its network
connector (Mooncake over TCP), so a streamed answer's audio chunks crossed pods to get here.

One deployed model for the three checks (text, audio, streamed audio): CI time is tight. Cost on the
2-core test bed (shared with other jobs): the graph served 289 s after apply, the test took 309 s.
"""

from __future__ import annotations

import base64
import io
import json
import re
import time
import wave
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from omnimodel_runtime.tiny import ensure_tiny
from omnimodel_testbed.kubelet import PodProcess, PodRunner
from support import Kube, example, healthy, wait_for

pytestmark = pytest.mark.vllm_omni

MODELS = Path.home() / ".cache" / "omnimodel" / "models"
EXAMPLE = "vllm-omni-qwen3-omni-tiny.yaml"


def log_text(pod: PodProcess) -> str:
    return pod.log_path.read_text(errors="replace")


def talkers_attached(head: PodProcess) -> set[str]:
    """The talker (stage 1) replica ids the head has attached, from its log."""
    return set(re.findall(r"replica attached stage=1 replica=(\d+)", log_text(head)))


def wav_frames(data: bytes) -> tuple[int, int, int]:
    """(channels, frame rate, frames) of a WAV file."""
    with wave.open(io.BytesIO(data)) as wav:
        return wav.getnchannels(), wav.getframerate(), wav.getnframes()


# Its own waits allow 1000 s for the four engines to start and register (the image graph takes a minute,
# this one several on a loaded 2-core machine): pytest-timeout's default 300 s must not cut them short.
@pytest.mark.timeout(2000)
def test_qwen3_omni_in_three_stages_on_three_vendors_answers_text_audio_and_streamed_audio(
    kube: Kube, pods: PodRunner
) -> None:
    started = time.monotonic()
    model_dir = ensure_tiny("qwen3-omni-vllm-omni", MODELS)
    # The example as shipped (its CPU engine arguments are documented there), on the tiny model just built.
    manifest = example(EXAMPLE)
    assert manifest["spec"]["model"]["source"] == f"file:///models/tiny/{model_dir.name}"
    kube.apply(manifest)
    base = f"http://q3-gateway.{kube.ns}.svc:8000"
    # 289 s alone; far more while make test's other lane runs beside it on the same 2 cores.
    wait_for(lambda: healthy(base), 1000, interval=2, what="the head's /health (every stage registered)")
    (head,) = pods.processes("q3-thinker-")
    # The second talker replica attaches after the head is whole (the head waits for one per stage). Its id
    # is the head's count of registrations: a replica restarted before it attached comes back as replica 2.
    wait_for(lambda: len(talkers_attached(head)) >= 2, 300, what="the second talker attached")
    # Ready only now: the kubelet's probes (the head's /health, each replica's registration) gate it.
    kube.wait_ready("q3", timeout=180)
    stage_pods = [
        p for p in kube.pods("app.kubernetes.io/instance=q3") if "omnimodel.io/stage" in p["metadata"]["labels"]
    ]
    nodes: dict[str, list[str]] = {}
    for pod in stage_pods:
        nodes.setdefault(pod["metadata"]["labels"]["omnimodel.io/stage"], []).append(pod["spec"]["nodeName"])
    assert [n[:4] for n in nodes["thinker"]] == ["h200"], nodes
    assert nodes["talker"] == ["mi300x-0", "mi300x-0"] and nodes["code2wav"] == ["ascend910b-0"], nodes
    # Both streaming edges cross pods through the network connector, with the config's chunking kept.
    config_map = kube.get("configmap", "q3-pipeline")
    deploy = yaml.safe_load(config_map["data"]["deploy.yaml"])
    assert deploy["async_chunk"] is True
    connectors = {s["stage_id"]: s.get("input_connectors") for s in deploy["stages"]}
    assert {deploy["connectors"][name]["name"] for c in (connectors[1], connectors[2]) for name in c.values()} == {
        "MooncakeStoreConnector"
    }

    up = time.monotonic() - started

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=180)
    text = client.chat.completions.create(
        model="qwen3-omni", messages=[{"role": "user", "content": "hello"}], extra_body={"modalities": ["text"]}
    )
    assert text.choices[0].message.content

    spoken = client.chat.completions.create(
        model="qwen3-omni",
        messages=[{"role": "user", "content": "hello"}],
        extra_body={"modalities": ["text", "audio"]},
    )
    audio = next((c.message.audio for c in spoken.choices if c.message.audio), None)
    assert audio is not None, spoken
    channels, rate, frames = wav_frames(base64.b64decode(audio.data))
    assert (channels, rate) == (1, 24000) and frames > 0

    # Streamed: the audio arrives in chunks while code2wav decodes (async_chunk), each a WAV of its own.
    chunks: list[bytes] = []
    with httpx.stream(
        "POST",
        f"{base}/v1/chat/completions",
        json={
            "model": "qwen3-omni",
            "messages": [{"role": "user", "content": "hello"}],
            "modalities": ["text", "audio"],
            "stream": True,
        },
        timeout=180,
    ) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if event.get("modality") == "audio":
                chunks.extend(
                    base64.b64decode(c["delta"]["content"]) for c in event["choices"] if c["delta"].get("content")
                )
    assert len(chunks) >= 2, f"{len(chunks)} audio chunk(s): the answer was not streamed"
    streamed = [wav_frames(c) for c in chunks]
    assert {(ch, r) for ch, r, _ in streamed} == {(1, 24000)} and sum(f for _, _, f in streamed) > 0
    print(
        f"qwen3-omni: serving {up:.0f}s after apply; {len(chunks)} streamed audio chunks "
        f"({sum(f for _, _, f in streamed)} frames); test {time.monotonic() - started:.0f}s"
    )
