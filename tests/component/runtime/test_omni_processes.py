"""Qwen2.5-Omni as real processes on loopback, driven by the official ``openai`` client: three
``omnimodel stage`` processes behind an ``omnimodel gateway`` (every hand-off over HTTP, rows and codes
streamed while they are produced). Through the processes the answer is still the whole model's answer,
byte for byte. (``serve``, everything in one process, is test_omni_pipeline.py; the benchmark runs the
``omnimodel serve`` command itself.)
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from omni_helpers import (
    QWEN25,
    USER,
    Qwen25Whole,
    audio_part,
    image_part,
    long_spoken_stream,
    png_file,
    spoken_chat,
    wav_file,
)
from runtime_procs import RuntimeProcess, openai_client, runtime_env, split_deployment, stage_requests, wav_of

from omnimodel_runtime.serve import serve_pipeline

pytestmark = [pytest.mark.engine]

MODEL = QWEN25
STAGES = ("thinker", "talker", "code2wav")
THREADS = 1


@pytest.fixture(scope="module")
def deployment(
    tmp_path_factory: pytest.TempPathFactory, model_cache: Path, tiny_omni: Path
) -> Iterator[dict[str, RuntimeProcess]]:
    """Thinker, talker and code2wav stage processes and a gateway, all started at once (the tiny model
    built before, not raced for by four processes)."""
    pipeline = serve_pipeline(MODEL, f"tiny://{MODEL}", device="cpu")
    # Three torch processes share the cores: one thread each instead of each taking all of them.
    env = runtime_env(model_cache, OMNIMODEL_DEVICE="cpu", OMP_NUM_THREADS=THREADS)
    with split_deployment(pipeline, tmp_path_factory.mktemp("omni-procs"), env, timeout=240) as procs:
        yield procs


def requests_per_stage(deployment: dict[str, RuntimeProcess]) -> dict[str, float]:
    return {name: stage_requests(deployment[name].metrics(), name) for name in STAGES}


@pytest.mark.slow
def test_openai_client_gets_the_whole_models_text_and_wav(
    deployment: dict[str, RuntimeProcess], whole_omni: Qwen25Whole
) -> None:
    spoken = spoken_chat(USER, voice="Ethan", max_tokens=20, seed=11)
    reply = openai_client(deployment["gateway"].url).chat.completions.create(**spoken)
    message = reply.choices[0].message
    assert message.audio is not None
    raw = wav_of(message.model_dump())  # checked: a WAV file, not empty
    text, wav = whole_omni.generate(USER, speaker="Ethan", max_tokens=20, seed=11, threads=THREADS)
    assert (message.content, message.audio.transcript) == (text, text)
    assert raw == wav


@pytest.mark.slow
def test_streamed_audio_arrives_before_the_text_ends(deployment: dict[str, RuntimeProcess]) -> None:
    # The first audio comes after a few hundred thinker tokens; with 400 the thinker could finish first.
    body = long_spoken_stream(max_tokens=2000)
    kinds: list[str] = []
    with httpx.stream("POST", f"{deployment['gateway'].url}/v1/chat/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                kinds.append("done")
                continue
            chunk: dict[str, Any] = json.loads(line[6:])
            delta = chunk["choices"][0]["delta"] if chunk["choices"] else {}
            if delta.get("content"):
                kinds.append("text")
            elif (delta.get("audio") or {}).get("data"):
                assert chunk["modality"] == "audio"
                kinds.append("audio")
    assert kinds[-1] == "done"
    last_text = len(kinds) - 1 - kinds[::-1].index("text")
    assert kinds.index("audio") < last_text


@pytest.mark.slow
def test_text_only_chat_never_reaches_talker_or_code2wav(deployment: dict[str, RuntimeProcess]) -> None:
    before = requests_per_stage(deployment)
    client = openai_client(deployment["gateway"].url)
    reply = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=8)  # type: ignore[arg-type]
    assert reply.choices[0].message.content
    assert reply.choices[0].message.audio is None
    after = requests_per_stage(deployment)
    assert after == {**before, "thinker": before["thinker"] + 1}


@pytest.mark.slow
def test_a_stage_process_refusing_the_voice_is_a_400_through_the_gateway(
    deployment: dict[str, RuntimeProcess],
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client(deployment["gateway"].url).chat.completions.create(
            model=MODEL,
            messages=USER,  # type: ignore[arg-type]
            modalities=["text", "audio"],
            audio={"voice": "Nobody", "format": "wav"},
        )
    assert "Chelsie, Ethan" in str(caught.value)


@pytest.mark.slow
def test_speech_through_stage_processes_streams_what_the_file_holds(deployment: dict[str, RuntimeProcess]) -> None:
    gateway = deployment["gateway"]
    # The gateway has no model files: it asks the thinker process for the voices.
    voices = httpx.get(f"{gateway.url}/v1/audio/voices", timeout=30).json()
    assert voices == {"voices": ["Chelsie", "Ethan"], "default": "Chelsie"}
    before = requests_per_stage(deployment)
    speech = openai_client(gateway.url).audio.speech
    whole = speech.create(model=MODEL, voice="Ethan", input="Hello from three processes.", response_format="pcm")
    assert whole.response.headers["x-sample-rate"] == "24000"
    with speech.with_streaming_response.create(
        model=MODEL, voice="Ethan", input="Hello from three processes.", extra_body={"stream": True}
    ) as resp:
        streamed = b"".join(resp.iter_bytes())
    a, b = np.frombuffer(whole.content, "<i2"), np.frombuffer(streamed, "<i2")
    assert a.size > 0
    assert a.shape == b.shape
    assert np.abs(a.astype(int) - b.astype(int)).max() <= 1  # code2wav's chunking tolerance, in 16 bits
    after = requests_per_stage(deployment)
    assert after == {name: count + 2 for name, count in before.items()}


@pytest.mark.slow
def test_voice_chat_through_stage_processes_answers_the_audio_as_the_whole_model_does(
    deployment: dict[str, RuntimeProcess], whole_omni: Qwen25Whole
) -> None:
    """Audio and an image in, text and audio out: their bytes travel to the thinker process in the request
    frame, the thinker's processor and encoders use them, and the answer is the whole model's."""
    content = [audio_part(wav_file(1)), image_part(png_file()), {"type": "text", "text": "What is this?"}]
    spoken = spoken_chat([{"role": "user", "content": content}], voice="Chelsie", max_tokens=12, seed=13)
    reply = openai_client(deployment["gateway"].url).chat.completions.create(**spoken)
    message = reply.choices[0].message
    assert message.audio is not None
    raw = wav_of(message.model_dump())
    text, wav = whole_omni.generate_content(content, speaker="Chelsie", max_tokens=12, seed=13, threads=THREADS)
    assert (message.content, message.audio.transcript) == (text, text)
    assert raw == wav
