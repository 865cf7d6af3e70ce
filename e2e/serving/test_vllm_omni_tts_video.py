"""vLLM-Omni's Qwen3-TTS and Wan2.2 video configs rendered by the operator and run for real, every pod a
process of the cached vLLM-Omni CPU environment on its own pod IP with its own /dev/shm:

- ``qwen3_tts``: a tiny random-weight Qwen3-TTS CustomVoice, the talker in the head pod on an nvidia node and
  code2wav on an amd node, the codec chunks crossing pods over the operator's network connector (Mooncake);
  speech from the official ``openai`` client (``audio.speech.create``) is a WAV that decodes.
- ``wan2_2_ti2v``: a tiny random-weight Wan2.2 TI2V-5B in one pod (the head: API server, orchestrator and
  the diffusion stage's only replica), answering a ``/v1/videos`` job with an MP4 that decodes to the asked
  size and frame count.

Cost on the 2-core test bed (shared with other jobs): see each test's docstring.
"""

from __future__ import annotations

import io
import time
import wave
from pathlib import Path

import av
import numpy as np
import openai
import pytest
import yaml
from openai.types import Video

from omnimodel_runtime.tiny import ensure_tiny
from omnimodel_testbed.kubelet import PodRunner
from support import Kube, example, healthy, wait_for

pytestmark = pytest.mark.vllm_omni

MODELS = Path.home() / ".cache" / "omnimodel" / "models"


def wav_samples(data: bytes) -> tuple[int, int, np.ndarray]:
    """(channels, frame rate, 16-bit samples) of a WAV file."""
    with wave.open(io.BytesIO(data)) as wav:
        assert wav.getsampwidth() == 2
        return wav.getnchannels(), wav.getframerate(), np.frombuffer(wav.readframes(wav.getnframes()), np.int16)


# Its /health wait allows 600 s for two engines to start and register on a loaded machine: pytest-timeout's
# 300 s default must not cut it short.
@pytest.mark.timeout(900)
def test_qwen3_tts_in_two_pods_speaks_a_wav_that_decodes(
    kube: Kube, pods: PodRunner, request: pytest.FixtureRequest
) -> None:
    """Cost on the 2-core test bed (load ~10): the head served 162 s after apply; the speech (16 code frames,
    1.2 s of audio) took 56 s (5 s by hand in one process over shared memory; where the rest goes across
    pods was not measured); the test 219 s."""
    started = time.monotonic()
    model_dir = ensure_tiny("tts-qwen3-vllm-omni", MODELS)
    manifest = example("vllm-omni-qwen3-tts-tiny.yaml")
    assert manifest["spec"]["model"]["source"] == f"file:///models/tiny/{model_dir.name}"
    kube.apply(manifest)
    base = f"http://q3tts-gateway.{kube.ns}.svc:8000"
    wait_for(lambda: healthy(base), 600, interval=2, what="the head's /health (talker and code2wav registered)")
    kube.wait_ready("q3tts", 120)
    nodes = {
        p["metadata"]["labels"]["omnimodel.io/stage"]: p["spec"]["nodeName"]
        for p in kube.pods("app.kubernetes.io/instance=q3tts")
        if "omnimodel.io/stage" in p["metadata"]["labels"]
    }
    assert nodes["qwen3-tts"].startswith("h200-") and nodes["code2wav"] == "mi300x-0", nodes
    assert len(pods.processes("q3tts-qwen3-tts-")) == len(pods.processes("q3tts-code2wav-")) == 1
    # The codec stream crosses pods through the network connector, with the config's chunking kept.
    deploy = yaml.safe_load(kube.get("configmap", "q3tts-pipeline")["data"]["deploy.yaml"])
    assert deploy["async_chunk"] is True
    (connector,) = deploy["connectors"].values()
    assert connector["name"] == "MooncakeStoreConnector" and connector["extra"]["codec_streaming"] is True
    up = time.monotonic() - started

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
    # Its pooled connection closed with the test, not left to the garbage collector at session end.
    request.addfinalizer(client.close)
    asked = time.monotonic()
    speech = client.audio.speech.create(
        model="qwen3-tts",
        # The model's own speaker, not one of OpenAI's voices.
        voice="vivian",
        input="hello there",
        response_format="wav",
    )
    took = time.monotonic() - asked
    channels, rate, samples = wav_samples(speech.content)
    assert (channels, rate) == (1, 24000) and len(samples) > 0
    assert np.abs(samples).max() > 0, "all zeros: silence came out of code2wav"
    print(f"qwen3-tts: serving {up:.0f}s after apply; speech {took:.1f}s, {len(samples)} samples")


def decoded_frames(mp4: bytes) -> tuple[list[np.ndarray], float]:
    """RGB frames and frame rate of an MP4."""
    with av.open(io.BytesIO(mp4), mode="r") as container:
        stream = container.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
        return frames, float(stream.average_rate or 0)


# Its /health wait allows 420 s (measured 98-269 s on a loaded machine): pytest-timeout's 300 s default must not
# cut it short.
@pytest.mark.timeout(600)
# openai 2.x warns that OpenAI's own (Sora) video service shuts down; its videos resource is still the API
# vLLM-Omni's /v1/videos implements.
@pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
def test_wan22_ti2v_in_one_pod_makes_a_video_job_that_decodes(
    kube: Kube, pods: PodRunner, request: pytest.FixtureRequest
) -> None:
    """Cost on the 2-core test bed: the head served 98 s after apply with the machine's load near 10, 269 s
    with more jobs beside it; the job (5 frames of 64 × 64, two steps) took 1.4 s; the test 99 s and 271 s."""
    started = time.monotonic()
    model_dir = ensure_tiny("text-to-video-ti2v-vllm-omni", MODELS)
    manifest = example("vllm-omni-wan22-tiny.yaml")
    assert manifest["spec"]["model"]["source"] == f"file:///models/tiny/{model_dir.name}"
    kube.apply(manifest)
    base = f"http://wan22-gateway.{kube.ns}.svc:8000"
    wait_for(lambda: healthy(base), 420, interval=2, what="the head's /health (the dit stage warmed up)")
    kube.wait_ready("wan22", 120)
    (pod,) = [
        p for p in kube.pods("app.kubernetes.io/instance=wan22") if "omnimodel.io/stage" in p["metadata"]["labels"]
    ]
    assert pod["metadata"]["labels"]["omnimodel.io/stage"] == "dit" and pod["spec"]["nodeName"].startswith("h200-")
    # One process: the head is the stage's only replica (no headless replica pod).
    (_head,) = pods.processes("wan22-")
    up = time.monotonic() - started

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
    # Its pooled connection closed with the test, not left to the garbage collector at session end.
    request.addfinalizer(client.close)
    asked = time.monotonic()
    job = client.videos.create(
        model="wan2.2-ti2v",
        prompt="a fox running",
        # Any multiple of 32 the model makes, not only OpenAI's sizes.
        size="64x64",  # type: ignore[arg-type]
        extra_body={"num_frames": 5, "fps": 4, "num_inference_steps": 2, "seed": 1},
    )
    assert job.status in ("queued", "in_progress"), job

    def finished() -> Video | None:
        current = client.videos.retrieve(job.id)
        return current if current.status in ("completed", "failed") else None

    done: Video = wait_for(finished, 180, interval=1, what="the video job to finish")
    assert (done.status, done.error) == ("completed", None), done
    content = client.videos.download_content(job.id)
    assert content.response.headers["content-type"] == "video/mp4"
    frames, rate = decoded_frames(content.content)
    assert len(frames) == 5 and {f.shape for f in frames} == {(64, 64, 3)} and rate == 4
    assert all(float(f.std()) > 0 for f in frames), "a constant frame: the VAE's output did not reach the MP4"
    took = time.monotonic() - asked
    print(f"wan2.2: serving {up:.0f}s after apply; job {took:.1f}s; test {time.monotonic() - started:.0f}s")
