"""Qwen2.5-Omni split into thinker -> talker -> code2wav stages (in process, ``serve``-shaped), on the tiny
random-weight model, against the whole model's own ``generate()``.

The equality is exact: the text, and the WAV the client receives is byte for byte the whole model's
waveform in 16-bit PCM (same seed, same input; greedy thinker, sampling talker). Streamed answers run
code2wav chunked; its audio equals a single pass over the same noise within :data:`CHUNKED_TOLERANCE`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from omni_helpers import (
    CHUNKED_TOLERANCE,
    QWEN25,
    USER,
    Qwen25Whole,
    chunked_code2wav,
    code2wav_one_pass,
    long_spoken_stream,
    spoken_chat,
)
from runtime_procs import (
    Served,
    hang_up_after_the_first_text,
    serve_fixture,
    served_over_tcp,
    sse_chunks,
    stage_requests,
    streamed_audio,
    wav_of,
)

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="module")]

MODEL = QWEN25


serve = serve_fixture(MODEL, "tiny_omni")


@pytest.mark.slow
async def test_split_stages_reproduce_the_whole_model_text_and_waveform(serve: Served, whole_omni: Qwen25Whole) -> None:
    http = serve.http
    # The official client, with OpenAI's audio.voice.
    reply = await serve.openai.chat.completions.create(**spoken_chat(USER, voice="Chelsie", max_tokens=24, seed=5))
    assert reply.choices[0].message.audio is not None
    text, wav = whole_omni.generate(USER, speaker="Chelsie", max_tokens=24, seed=5)
    assert reply.choices[0].message.content == text
    assert reply.choices[0].message.audio.transcript == text
    assert wav_of(reply.choices[0].message.model_dump()) == wav
    # vLLM-Omni's speaker picks from the same speaker map: another voice, another (still exact) waveform.
    body = {"model": MODEL, "messages": USER, "modalities": ["text", "audio"], "max_tokens": 24, "temperature": 0}
    resp = await http.post("/v1/chat/completions", json={**body, "seed": 5, "speaker": "Ethan"})
    assert resp.status_code == 200, resp.text
    text, ethan = whole_omni.generate(USER, speaker="Ethan", max_tokens=24, seed=5)
    assert resp.json()["choices"][0]["message"]["content"] == text
    assert wav_of(resp.json()["choices"][0]["message"]) == ethan != wav


@pytest.mark.slow
async def test_vllm_omni_client_voice_names_reach_the_speaker_map(serve: Served) -> None:
    http = serve.http
    # examples/online_serving/qwen2_5_omni/openai_chat_completion_client_for_multimodal_generation.py
    # (text query): a system prompt and content parts, its per-stage sampling list nested in extra_body.
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "You are Qwen, a virtual human."}]},
        {"role": "user", "content": [{"type": "text", "text": "Say something."}]},
    ]
    body = {
        "model": MODEL,
        "messages": messages,
        "modalities": ["text", "audio"],
        "max_tokens": 12,
        "temperature": 0,
        "seed": 5,
        "extra_body": {"sampling_params_list": [{"temperature": 0.0}, {"temperature": 0.9}, {"temperature": 0.0}]},
    }

    async def wav(**voice: Any) -> bytes:
        resp = await http.post("/v1/chat/completions", json={**body, **voice})
        assert resp.status_code == 200, resp.text
        return wav_of(resp.json()["choices"][0]["message"])

    chelsie = await wav(audio={"voice": "Chelsie"})
    assert await wav(audio={"voice": "alloy", "format": "wav"}) == chelsie  # OpenAI's names: the default voice
    assert await wav(voice="ethan") == await wav(speaker="Ethan") != chelsie  # vLLM-Omni's top-level voice
    resp = await http.post("/v1/chat/completions", json={**body, "voice": "bob"})
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "audio.voice"
    assert "Chelsie" in resp.json()["error"]["message"]


@pytest.mark.slow
async def test_streamed_audio_starts_before_the_text_ends(serve: Served) -> None:
    # Long enough that the talker has its first chunk of codes long before the thinker is done: the
    # first audio comes after 200-450 thinker tokens on two loaded CPU cores (400 lost that race).
    resp = await serve.http.post("/v1/chat/completions", json=long_spoken_stream(max_tokens=2000))
    assert resp.status_code == 200
    chunks = [c for c in sse_chunks(resp.text) if c["choices"]]
    text_at = [i for i, c in enumerate(chunks) if c["choices"][0]["delta"].get("content")]
    audio_at = [i for i, c in enumerate(chunks) if c["modality"] == "audio" and streamed_audio([c])]
    assert len(audio_at) >= 2  # chunked: more than one piece
    assert audio_at[0] < text_at[-1]
    samples = np.frombuffer(b"".join(streamed_audio(chunks[i] for i in audio_at)), dtype="<i2")
    assert samples.size > 0
    assert float(np.sqrt(np.mean((samples / 32767.0) ** 2))) > 0.01  # audible, not silence


@pytest.mark.slow
async def test_text_only_chat_never_reaches_the_talker_or_code2wav(serve: Served) -> None:
    http = serve.http
    before = (await http.get("/metrics")).text
    for modalities in (None, ["text"]):
        body: dict[str, Any] = {"model": MODEL, "messages": USER, "max_tokens": 8}
        if modalities:
            body["modalities"] = modalities
        resp = await http.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200
        message = resp.json()["choices"][0]["message"]
        assert message["content"]
        assert message["audio"] is None
    after = (await http.get("/metrics")).text
    assert stage_requests(after, "thinker") == stage_requests(before, "thinker") + 2
    for stage in ("talker", "code2wav"):
        assert stage_requests(after, stage) == stage_requests(before, stage)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"audio": {"voice": "Nobody"}}, "audio.voice"),
        ({"speaker": "Nobody"}, "audio.voice"),
        ({"modalities": ["text", "video"]}, "modalities.1"),
        ({"messages": []}, "messages"),
    ],
)
async def test_bad_input_gets_a_4xx_envelope(serve: Served, extra: dict[str, Any], param: str) -> None:
    for stream in (False, True):
        body = {"model": MODEL, "messages": USER, "modalities": ["text", "audio"], "stream": stream, **extra}
        resp = await serve.http.post("/v1/chat/completions", json=body)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == param


@pytest.mark.slow
async def test_chunked_code2wav_matches_one_pass_over_the_same_noise(serve: Served) -> None:
    import torch

    engine = serve.engine("code2wav")
    codes = torch.randint(0, 64, (100,), generator=torch.Generator().manual_seed(0)).numpy()
    pieces = await chunked_code2wav(engine, codes, seed=7, request_id="chunked")
    assert len(pieces) > 2
    chunked = np.concatenate(pieces)
    single = code2wav_one_pass(engine, codes, seed=7)
    assert chunked.shape == single.shape == (len(codes) * int(engine.model.code2wav_dit_model.repeats) * 240,)
    assert float(np.abs(chunked - single).max()) < CHUNKED_TOLERANCE


@pytest.mark.slow
async def test_a_client_going_away_stops_every_stage(serve: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real HTTP client of the gateway (TCP, not ASGI in memory) asks for a long spoken answer, reads
    its first text delta and hangs up: the worker of every stage ends that request as cancelled, long
    before the thousands of thinker steps it asked for."""
    from omnimodel_runtime.engines.worker import CancelledRequestError

    engines = {name: serve.engine(name) for name in ("thinker", "talker", "code2wav")}
    cancelled: dict[str, list[str]] = {name: [] for name in engines}
    for name, engine in engines.items():

        def run(job: Any, *, _run: Any = engine.run, _name: str = name) -> None:
            try:
                _run(job)
            except CancelledRequestError:
                cancelled[_name].append(job.request.request_id)
                raise

        monkeypatch.setattr(engine, "run", run)

    async with served_over_tcp(serve.app) as url:
        # Thousands of thinker steps: far longer than the deadline below, unless the request is aborted.
        # It hangs up once the thinker is writing: its talker and code2wav have their jobs running.
        await hang_up_after_the_first_text(url, long_spoken_stream(max_tokens=4000))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while not all(cancelled.values()) or any(engine.busy for engine in engines.values()):
            assert loop.time() < deadline, f"a stage kept working for a client that went away (cancelled: {cancelled})"
            await asyncio.sleep(0.05)
    # One request, the same one, everywhere.
    assert len({tuple(ids) for ids in cancelled.values()}) == 1
    assert all(len(ids) == 1 for ids in cancelled.values())
