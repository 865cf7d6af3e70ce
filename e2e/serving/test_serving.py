"""Real requests through the gateway pod to stage pods, placed by the real scheduler, found through
their headless Service's DNS name, with the official openai client."""

from __future__ import annotations

import io
import socket
import wave

import httpx
import openai

from omnimodel_testbed.kubelet import PodRunner
from support import Kube, example, healthy, stage_requests, wait_for


def test_chat_through_gateway_and_stage_pods(kube: Kube, pods: PodRunner) -> None:
    kube.apply(example("text-tiny.yaml"))
    kube.wait_ready("text-tiny")
    gateway = f"text-tiny-gateway.{kube.ns}.svc"
    # the Service name resolves (cluster DNS from EndpointSlices) to the gateway pod's IP
    addresses = {info[4][0] for info in socket.getaddrinfo(gateway, 8000, type=socket.SOCK_STREAM)}
    assert addresses == {p.ip for p in pods.processes("text-tiny-gateway")}
    base = f"http://{gateway}:8000"
    wait_for(lambda: healthy(base), 180, interval=0.5, what="gateway /health 200 (stage loaded and warm)")

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
    models = [m.id for m in client.models.list().data]
    assert models == ["text"]
    reply = client.chat.completions.create(
        model="text", messages=[{"role": "user", "content": "hello"}], max_tokens=8, seed=1
    )
    assert reply.choices[0].message.content
    assert reply.usage is not None
    assert reply.usage.completion_tokens > 0
    (stage,) = pods.processes("text-tiny-llm")
    assert stage_requests(f"http://{stage.ip}:8001") == 1


def test_scaled_stage_pods_share_the_traffic(kube: Kube, pods: PodRunner) -> None:
    doc = example("text-tiny.yaml")
    doc["spec"]["stages"][0]["replicas"] = 2
    kube.apply(doc)
    kube.wait_ready("text-tiny")
    base = f"http://text-tiny-gateway.{kube.ns}.svc:8000"
    wait_for(lambda: len(pods.processes("text-tiny-llm")) == 2, 60, what="two stage processes")
    stages = [f"http://{p.ip}:8001" for p in pods.processes("text-tiny-llm")]
    wait_for(lambda: all(healthy(u) for u in [*stages, base]), 180, interval=0.5, what="all pods healthy")
    # the gateway finds both pods through the headless Service and balances across them
    # Seen and in its pool: a pod that has just loaded may still answer a probe late, and the gateway
    # keeps an endpoint out of the pool until a probe is answered in time.
    wait_for(
        lambda: (
            [e["healthy"] for e in httpx.get(f"{base}/health", timeout=5).json()["stages"]["llm"]["endpoints"]]
            == [True, True]
        ),
        60,
        what="gateway sees both stage pods healthy",
    )
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
    for i in range(6):
        client.chat.completions.create(model="text", messages=[{"role": "user", "content": f"q{i}"}], max_tokens=4)
    served = [stage_requests(u) for u in stages]
    assert sum(served) == 6
    assert all(n > 0 for n in served), served


def test_speech_through_two_stage_pods(kube: Kube, pods: PodRunner) -> None:
    """The tts example: the gateway pod relays the acoustic pod's mel, as it streams, into the vocoder pod."""
    kube.apply(example("tts.yaml"))
    kube.wait_ready("speech")
    base = f"http://speech-gateway.{kube.ns}.svc:8000"
    wait_for(lambda: healthy(base), 180, interval=0.5, what="gateway /health 200 (both stages warm)")
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
    wav = client.audio.speech.create(model="tts", voice="default", input="hello from the cluster").read()
    assert wav[:4] == b"RIFF"
    with wave.open(io.BytesIO(wav)) as audio:
        assert (audio.getnchannels(), audio.getframerate()) == (1, 16000)
        assert audio.getnframes() > 0
    with client.audio.speech.with_streaming_response.create(
        model="tts", voice="default", input="hello from the cluster", response_format="pcm", extra_body={"stream": True}
    ) as streamed:
        pcm = b"".join(streamed.iter_bytes())
    # OpenAI's pcm is 24 kHz 16-bit mono: the same audio as the 16 kHz WAV, resampled (within a sample).
    assert len(pcm) % 2 == 0
    assert abs(len(pcm) // 2 - audio.getnframes() * 24000 / audio.getframerate()) <= 1
    for stage in ("speech-acoustic", "speech-vocoder"):
        (proc,) = pods.processes(stage)
        assert stage_requests(f"http://{proc.ip}:8001") == 2, stage
