"""vLLM-Omni's Wan2.2 video config rendered by the operator and run for real: a tiny random-weight Wan2.2
TI2V-5B in one pod (the head: API server, orchestrator and the diffusion stage's only replica), a process
of the cached vLLM-Omni CPU environment on its own pod IP, answering a ``/v1/videos`` job from the
official ``openai`` client with an MP4 that decodes to the asked size and frame count.

Cost on the 2-core test bed (shared with other jobs): see each test's docstring. Qwen3-TTS (``qwen3_tts``)
is not here yet; docs/vllm-omni.md (section Qwen3-TTS) says what it takes.
"""

from __future__ import annotations

import io
import time
from pathlib import Path

import av
import numpy as np
import openai
import pytest
from openai.types import Video

from omnimodel_runtime.tiny import ensure_tiny
from omnimodel_testbed.kubelet import PodRunner
from support import Kube, example, healthy, wait_for

pytestmark = pytest.mark.vllm_omni

MODELS = Path.home() / ".cache" / "omnimodel" / "models"


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
def test_wan22_ti2v_in_one_pod_makes_a_video_job_that_decodes(kube: Kube, pods: PodRunner) -> None:
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
