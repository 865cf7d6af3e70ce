"""Qwen2.5-Omni as real processes on loopback, driven by the official ``openai`` client: three
``omnimodel stage`` processes behind an ``omnimodel gateway`` (every hand-off over HTTP, rows and codes
streamed while they are produced). Through the processes the answer is still the whole model's answer,
byte for byte. (``serve``, everything in one process, is test_omni_pipeline.py; the benchmark runs the
``omnimodel serve`` command itself.)
"""

from __future__ import annotations

import base64
import io
import json
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from runtime_procs import RuntimeProcess, free_port, running, runtime_env
from test_omni_pipeline import MODEL, USER, Whole, stage_requests

from omnimodel_runtime.serve import serve_pipeline

pytestmark = [pytest.mark.engine, pytest.mark.slow]

STAGES = ("thinker", "talker", "code2wav")
THREADS = 1


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[dict[str, RuntimeProcess]]:
    """Thinker, talker and code2wav stage processes and a gateway, all started at once."""
    from omnimodel_runtime.tiny import ensure_tiny

    ensure_tiny(MODEL, model_cache)  # built once here, not raced for by four processes
    tmp = tmp_path_factory.mktemp("omni-procs")
    ports = {name: free_port() for name in (*STAGES, "gateway")}
    pipeline = serve_pipeline(MODEL, f"tiny://{MODEL}", device="cpu")
    stages = tuple(s.model_copy(update={"endpoints": (f"http://127.0.0.1:{ports[s.name]}",)}) for s in pipeline.stages)
    path = tmp / "pipeline.json"
    path.write_text(pipeline.model_copy(update={"stages": stages}).to_json())
    # Three torch processes share the cores: one thread each instead of each taking all of them.
    env = runtime_env(model_cache, OMNIMODEL_DEVICE="cpu", OMP_NUM_THREADS=THREADS)
    procs = {
        name: RuntimeProcess(
            name, ["stage", "--pipeline", str(path), "--stage", name], log_dir=tmp, env=env, port=ports[name]
        )
        for name in STAGES
    }
    procs["gateway"] = RuntimeProcess(
        "gateway", ["gateway", "--pipeline", str(path)], log_dir=tmp, env=env, port=ports["gateway"]
    )
    with running(*procs.values()):
        for proc in procs.values():
            proc.wait_healthy(timeout=240)
        yield procs


@pytest.fixture(scope="module")
def whole(model_cache: Path) -> Whole:
    from omnimodel_runtime.tiny import ensure_tiny

    return Whole(ensure_tiny(MODEL, model_cache))


def client(proc: RuntimeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proc.url}/v1", api_key="unused", max_retries=0, timeout=120)


def decoded_wav(data: str) -> tuple[bytes, int]:
    raw = base64.b64decode(data)
    assert raw[:4] == b"RIFF"
    with wave.open(io.BytesIO(raw)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
        return raw, w.getnframes()


def metrics(proc: RuntimeProcess) -> str:
    resp = proc.get("/metrics")
    assert resp is not None
    return resp.text


def test_openai_client_gets_the_whole_models_text_and_wav(deployment: dict[str, RuntimeProcess], whole: Whole) -> None:
    reply = client(deployment["gateway"]).chat.completions.create(
        model=MODEL,
        messages=USER,  # type: ignore[arg-type]
        modalities=["text", "audio"],
        audio={"voice": "Ethan", "format": "wav"},
        max_tokens=20,
        temperature=0,
        seed=11,
    )
    message = reply.choices[0].message
    assert message.audio is not None
    raw, frames = decoded_wav(message.audio.data)
    assert frames > 0
    text, wav = whole.generate(USER, speaker="Ethan", max_tokens=20, seed=11, threads=THREADS)
    assert (message.content, message.audio.transcript) == (text, text)
    assert raw == wav


def test_streamed_audio_arrives_before_the_text_ends(deployment: dict[str, RuntimeProcess]) -> None:
    body = {
        "model": MODEL,
        "messages": USER,
        "modalities": ["text", "audio"],
        "stream": True,
        # The first audio comes after a few hundred thinker tokens; with 400 the thinker could finish first.
        "max_tokens": 2000,
        "ignore_eos": True,
        "temperature": 0,
    }
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


def test_text_only_chat_never_reaches_talker_or_code2wav(deployment: dict[str, RuntimeProcess]) -> None:
    gateway = deployment["gateway"]
    before = {name: stage_requests(metrics(deployment[name]), name) for name in STAGES}
    reply = client(gateway).chat.completions.create(model=MODEL, messages=USER, max_tokens=8)  # type: ignore[arg-type]
    assert reply.choices[0].message.content
    assert reply.choices[0].message.audio is None
    after = {name: stage_requests(metrics(deployment[name]), name) for name in STAGES}
    assert after == {**before, "thinker": before["thinker"] + 1}


def test_a_stage_process_refusing_the_voice_is_a_400_through_the_gateway(
    deployment: dict[str, RuntimeProcess],
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client(deployment["gateway"]).chat.completions.create(
            model=MODEL,
            messages=USER,  # type: ignore[arg-type]
            modalities=["text", "audio"],
            audio={"voice": "Nobody", "format": "wav"},
        )
    assert "Chelsie, Ethan" in str(caught.value)


def test_speech_through_stage_processes_streams_what_the_file_holds(deployment: dict[str, RuntimeProcess]) -> None:
    gateway = deployment["gateway"]
    # The gateway has no model files: it asks the thinker process for the voices.
    voices = httpx.get(f"{gateway.url}/v1/audio/voices", timeout=30).json()
    assert voices == {"voices": ["Chelsie", "Ethan"], "default": "Chelsie"}
    before = {name: stage_requests(metrics(deployment[name]), name) for name in STAGES}
    speech = client(gateway).audio.speech
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
    after = {name: stage_requests(metrics(deployment[name]), name) for name in STAGES}
    assert after == {name: count + 2 for name, count in before.items()}


def test_voice_chat_through_stage_processes_answers_the_audio_as_the_whole_model_does(
    deployment: dict[str, RuntimeProcess], whole: Whole
) -> None:
    """Audio and an image in, text and audio out: their bytes travel to the thinker process in the request
    frame, the thinker's processor and encoders use them, and the answer is the whole model's."""
    from test_omni_inputs import audio_part, image_part, png_file, wav_file, whole_generate

    content = [audio_part(wav_file(1)), image_part(png_file()), {"type": "text", "text": "What is this?"}]
    reply = client(deployment["gateway"]).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],  # type: ignore[list-item]
        modalities=["text", "audio"],
        audio={"voice": "Chelsie", "format": "wav"},
        max_tokens=12,
        temperature=0,
        seed=13,
    )
    message = reply.choices[0].message
    assert message.audio is not None
    raw, _ = decoded_wav(message.audio.data)
    text, wav = whole_generate(whole, content, speaker="Chelsie", max_tokens=12, seed=13, threads=THREADS)
    assert (message.content, message.audio.transcript) == (text, text)
    assert raw == wav
