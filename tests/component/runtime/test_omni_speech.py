"""``/v1/audio/speech`` on the ``qwen2.5-omni`` preset: ``omnimodel serve --preset qwen2.5-omni --model
tiny://qwen2.5-omni`` as a real process, driven by the official ``openai`` client. The thinker speaks the
input (a forced reply, test_omni_forced_reply.py), the talker and code2wav run as for chat.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from runtime_procs import RuntimeProcess, openai_client, running, runtime_env, serve_process, wav_samples

pytestmark = [pytest.mark.engine]

MODEL = "qwen2.5-omni"
RATE = 24000
TEXT = "Good morning! The weather today is sunny, with a light breeze."
# code2wav's chunked path equals its one pass over the same noise within 1e-5 (docs/pipelines/qwen2.5-omni.md);
# after rounding to 16 bits that is at most one step.
STREAM_TOLERANCE_LSB = 1


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory, model_cache: Path, tiny_omni: Path) -> Iterator[RuntimeProcess]:
    # Its three engines share one process: one intra-op thread each keeps the shared cores free.
    env = runtime_env(model_cache, OMNIMODEL_DEVICE="cpu", OMP_NUM_THREADS=1)
    proc = serve_process(MODEL, tmp_path_factory.mktemp("omni-speech"), env)
    with running(proc):
        yield proc.wait_healthy(timeout=240)


@pytest.fixture(scope="module")
def client(serve: RuntimeProcess) -> openai.OpenAI:
    return openai_client(serve.url)


def speak(serve: RuntimeProcess, **body: Any) -> httpx.Response:
    return httpx.post(f"{serve.url}/v1/audio/speech", json={"model": MODEL, "input": TEXT, **body}, timeout=120)


@pytest.mark.slow
def test_openai_client_gets_24khz_audio_and_the_stream_equals_the_file(client: openai.OpenAI) -> None:
    whole = client.audio.speech.create(model=MODEL, voice="Chelsie", input=TEXT)
    assert whole.response.headers["content-type"] == "audio/wav"
    assert whole.response.headers["x-sample-rate"] == str(RATE)
    samples = wav_samples(whole.content, RATE)
    # The tiny talker speaks its 64-code cap (1.28 s at 480 samples per code).
    assert samples.size == 64 * 480
    assert np.sqrt(np.mean((samples / 32767.0) ** 2)) > 0.01  # audible, not silence

    with client.audio.speech.with_streaming_response.create(
        model=MODEL, voice="Chelsie", input=TEXT, response_format="pcm", extra_body={"stream": True}
    ) as resp:
        assert resp.headers["content-type"] == "audio/pcm"
        assert int(resp.headers["x-sample-rate"]) == RATE
        chunks = list(resp.iter_bytes())
    streamed = np.frombuffer(b"".join(chunks), "<i2")
    assert streamed.shape == samples.shape
    assert np.abs(streamed.astype(int) - samples.astype(int)).max() <= STREAM_TOLERANCE_LSB


@pytest.mark.slow
def test_voices_are_the_speaker_map(serve: RuntimeProcess, client: openai.OpenAI) -> None:
    assert httpx.get(f"{serve.url}/v1/audio/voices").json() == {"voices": ["Chelsie", "Ethan"], "default": "Chelsie"}
    chelsie = client.audio.speech.create(model=MODEL, voice="Chelsie", input=TEXT).content
    # No voice, "default" (the API's default) and any casing name the same speaker; seeds default to 0.
    assert speak(serve).content == chelsie
    assert client.audio.speech.create(model=MODEL, voice="default", input=TEXT).content == chelsie
    ethan = speak(serve, voice="ethan", seed=0).content
    assert wav_samples(ethan, RATE).size > 0
    assert ethan != chelsie
    for stream in (False, True):
        resp = speak(serve, voice="Nobody", stream=stream)
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == "voice"
        assert "Chelsie, Ethan" in error["message"]


@pytest.mark.slow
def test_the_same_seed_gives_the_same_audio(serve: RuntimeProcess) -> None:
    first = speak(serve, seed=7, response_format="pcm")
    assert first.headers["content-type"] == "audio/pcm"
    assert speak(serve, seed=7, response_format="pcm").content == first.content
    assert speak(serve, seed=8, response_format="pcm").content != first.content


@pytest.mark.slow
def test_speed_time_stretches_the_speech(serve: RuntimeProcess) -> None:
    normal = np.frombuffer(speak(serve, response_format="pcm").content, "<i2")
    frames = normal.size // 240  # BigVGAN: 240 samples per mel frame
    for speed in (2.0, 0.5):
        resp = speak(serve, response_format="pcm", speed=speed)
        assert resp.status_code == 200
        stretched = np.frombuffer(resp.content, "<i2")
        assert stretched.size == (int((frames - 1) / speed) + 1) * 240
    # Stretching chunk by chunk as the mel streams changes nothing beyond the chunking tolerance.
    whole = np.frombuffer(speak(serve, response_format="pcm", speed=1.5).content, "<i2")
    streamed = np.frombuffer(speak(serve, stream=True, speed=1.5).content, "<i2")
    assert streamed.shape == whole.shape
    assert np.abs(streamed.astype(int) - whole.astype(int)).max() <= STREAM_TOLERANCE_LSB


@pytest.mark.slow
@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": " \n\t"}, "input"),
        ({"input": "x" * 4097}, "input"),
        # Under OpenAI's character limit but longer than the tiny thinker's context once framed.
        ({"input": "x" * 2500}, "input"),
        ({"speed": 0.1}, "speed"),
        ({"speed": 4.5}, "speed"),
        ({"response_format": "aac"}, "response_format"),
        ({"instructions": "whisper"}, "instructions"),
        ({"stream_format": "sse"}, "stream_format"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(serve: RuntimeProcess, body: dict[str, Any], param: str) -> None:
    for stream in (False, True):
        resp = speak(serve, **{**body, "stream": stream})
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == param


@pytest.mark.slow
def test_a_stream_in_a_container_format_is_a_400(serve: RuntimeProcess) -> None:
    resp = speak(serve, stream=True, response_format="wav")
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "response_format"
