"""``/v1/audio/speech`` on real processes: ``omnimodel serve --preset tts --model tiny://tts``, and the
two stages as separate ``omnimodel stage`` processes behind ``omnimodel gateway``, driven by the official
``openai`` client (the issue's acceptance)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from runtime_procs import (
    RuntimeProcess,
    metric_value,
    openai_client,
    running,
    runtime_env,
    serve_process,
    split_deployment,
    wav_samples,
)

from omnimodel_runtime.serve import serve_pipeline

pytestmark = [pytest.mark.engine]

TEXT = "The quick brown fox jumps over the lazy dog."
# 4 mel frames per token on the tiny model: long enough that decoding is still going on (well over a
# second) when the first audio bytes arrive.
LONG = "A long sentence for the tiny speech model to say, again and again. " * 4


def _env(model_cache: Path) -> dict[str, str]:
    # One intra-op thread per process: several processes share two cores here.
    return runtime_env(model_cache, OMNIMODEL_HEALTH_INTERVAL=0.5, OMP_NUM_THREADS=1)


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory, model_cache: Path, tiny_tts: Path) -> Iterator[RuntimeProcess]:
    proc = serve_process("tts", tmp_path_factory.mktemp("tts-serve"), _env(model_cache))
    with running(proc):
        yield proc.wait_healthy()


@pytest.fixture(scope="module")
def split(
    tmp_path_factory: pytest.TempPathFactory, model_cache: Path, tiny_tts: Path
) -> Iterator[tuple[RuntimeProcess, RuntimeProcess, RuntimeProcess]]:
    """acoustic and vocoder as separate stage processes, and a gateway, from one pipeline file."""
    pipeline = serve_pipeline("tts", "tiny://tts", device="cpu")
    with split_deployment(pipeline, tmp_path_factory.mktemp("tts-split"), _env(model_cache)) as procs:
        yield procs["acoustic"], procs["vocoder"], procs["gateway"]


def _streamed(client: openai.OpenAI, text: str) -> tuple[int, list[bytes]]:
    with client.audio.speech.with_streaming_response.create(
        model="tts", voice="alto", input=text, response_format="pcm", extra_body={"stream": True}
    ) as resp:
        rate = int(resp.headers["x-sample-rate"])
        return rate, list(resp.iter_bytes())


@pytest.mark.slow
def test_openai_client_gets_audio_and_its_stream_equals_the_whole_response(serve: RuntimeProcess) -> None:
    client = openai_client(serve.url)
    whole = client.audio.speech.create(model="tts", voice="alto", input=TEXT)
    samples = wav_samples(whole.content, rate=16000)
    # The tiny model speaks 4 mel frames (of 256 samples) per token, the text is ~46 tokens.
    assert 40 * 4 * 256 <= len(samples) <= 50 * 4 * 256
    assert np.abs(samples).mean() > 300  # audible, not silence

    # Raw pcm is OpenAI's 24 kHz (the model speaks at 16): read so, it lasts as long as the wav.
    pcm = np.frombuffer(
        client.audio.speech.create(model="tts", voice="alto", input=TEXT, response_format="pcm").content, "<i2"
    )
    assert abs(len(pcm) / 24000 - len(samples) / 16000) <= 1 / 24000
    stream_rate, chunks = _streamed(client, TEXT)
    assert stream_rate == 24000
    streamed = np.frombuffer(b"".join(chunks), "<i2")
    assert streamed.shape == pcm.shape
    # Stated tolerance: chunked vocoding rounds differently from one whole pass (at most 1 LSB at 16 kHz,
    # which the resampling filter may carry into a neighbouring sample or two).
    assert np.abs(streamed.astype(int) - pcm.astype(int)).max() <= 2


@pytest.mark.slow
def test_first_audio_leaves_while_the_acoustic_stage_is_still_decoding(serve: RuntimeProcess) -> None:
    body = {"model": "tts", "voice": "default", "input": LONG, "stream": True}
    with httpx.stream("POST", f"{serve.url}/v1/audio/speech", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        chunks = resp.iter_raw()
        first = next(chunks)
        metrics = serve.get("/metrics")
        assert metrics is not None
        in_flight = metric_value(metrics.text, "omnimodel_requests_in_flight", {"stage": "acoustic"})
        rest = b"".join(chunks)
    assert 0 < len(first) < len(rest)
    assert in_flight == 1, "the first audio bytes should arrive before the acoustic stage has finished"


@pytest.mark.slow
def test_separate_stage_processes_give_the_same_audio_as_in_process(
    serve: RuntimeProcess, split: tuple[RuntimeProcess, RuntimeProcess, RuntimeProcess]
) -> None:
    acoustic, vocoder, gateway = split
    local, remote = openai_client(serve.url), openai_client(gateway.url)
    assert remote.audio.speech.create(model="tts", voice="bass", input=TEXT, speed=1.25).content == (
        local.audio.speech.create(model="tts", voice="bass", input=TEXT, speed=1.25).content
    )
    assert b"".join(_streamed(remote, TEXT)[1]) == b"".join(_streamed(local, TEXT)[1])
    assert httpx.get(f"{gateway.url}/v1/audio/voices").json() == {
        "voices": ["alto", "bass", "default"],
        "default": "default",
    }
    for stage in (acoustic, vocoder):
        metrics = stage.get("/metrics")
        assert metrics is not None
        assert (metric_value(metrics.text, "omnimodel_stage_requests_total", {"outcome": "ok"}) or 0) >= 2


@pytest.mark.slow
@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "hello", "voice": "nobody"}, "voice"),
        ({"input": "x" * 700}, "input"),
        ({"input": "hello", "response_format": "aac"}, "response_format"),
        ({"input": "hello", "speed": 10}, "speed"),
        ({"input": ""}, "input"),
    ],
)
def test_bad_input_through_separate_processes_is_a_4xx(
    split: tuple[RuntimeProcess, RuntimeProcess, RuntimeProcess], body: dict[str, object], param: str
) -> None:
    gateway = split[2]
    for stream in (False, True):
        resp = httpx.post(f"{gateway.url}/v1/audio/speech", json={**body, "stream": stream}, timeout=60)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == param
