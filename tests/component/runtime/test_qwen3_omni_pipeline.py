"""Qwen3-Omni split into thinker -> talker -> code2wav stages (``omnimodel serve``'s app, in process, over a
real TCP port for the streamed answer), on the tiny random-weight model, against the whole
``Qwen3OmniMoeForConditionalGeneration.generate()``.

The equality is exact: the text token for token, and the WAV the client receives is byte for byte the
whole model's waveform in 16-bit PCM (same seed; greedy thinker, sampling talker and code predictor). A
streamed answer runs code2wav in chunks of 12 codes with left context and one code of look-ahead; it stays
within ``omni_helpers.QWEN3_STREAM_TOLERANCE_LSB`` of the whole model's waveform.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from omni_helpers import QWEN3, QWEN3_MARKS, USER, Qwen3Whole, assert_qwen3_stream_matches, spoken_chat
from runtime_procs import Served, serve_fixture, stage_requests, streamed_chat_over_tcp, wav_of

pytestmark = QWEN3_MARKS

MODEL = QWEN3
SYSTEM = [{"role": "system", "content": "You are a tiny model."}, *USER]


serve = serve_fixture(MODEL, "tiny_qwen3")


@pytest.mark.slow
@pytest.mark.parametrize(("voice", "messages"), [("Ethan", USER), ("Chelsie", SYSTEM)])
async def test_split_stages_reproduce_the_whole_model_text_and_waveform(
    serve: Served, whole_qwen3: Qwen3Whole, voice: str, messages: list[dict[str, str]]
) -> None:
    spoken = spoken_chat(messages, voice=voice, max_tokens=16, seed=5, model=MODEL)
    reply = await serve.openai.chat.completions.create(**spoken)
    message = reply.choices[0].message
    assert message.audio is not None
    text, wav = whole_qwen3.generate(messages, speaker=voice, max_tokens=16, seed=5)
    assert message.content == text
    assert message.audio.transcript == text
    assert wav_of(message.model_dump()) == wav


@pytest.mark.slow
async def test_voices_differ_and_the_default_is_the_whole_models(serve: Served) -> None:
    body = {"model": MODEL, "messages": USER, "modalities": ["text", "audio"], "max_tokens": 8, "temperature": 0}

    async def wav(**voice: Any) -> bytes:
        resp = await serve.http.post("/v1/chat/completions", json={**body, "seed": 3, **voice})
        assert resp.status_code == 200, resp.text
        return wav_of(resp.json()["choices"][0]["message"])

    ethan = await wav()
    assert await wav(audio={"voice": "ethan"}) == ethan != await wav(audio={"voice": "Aiden"})
    resp = await serve.http.post("/v1/chat/completions", json={**body, "audio": {"voice": "Nobody"}})
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "audio.voice"
    assert "Aiden" in resp.json()["error"]["message"]


@pytest.mark.slow
async def test_streamed_answer_over_tcp_with_the_openai_client(serve: Served, whole_qwen3: Qwen3Whole) -> None:
    chunks = await streamed_chat_over_tcp(
        serve.app, model=MODEL, messages=USER, modalities=["text", "audio"], max_tokens=16, temperature=0, seed=5
    )
    whole_text, wav = whole_qwen3.generate(USER, speaker="Ethan", max_tokens=16, seed=5)
    # 24 codes in chunks of 12, joined without a gap: the whole waveform within the stated tolerance.
    assert_qwen3_stream_matches(chunks, whole_text, wav)


@pytest.mark.slow
async def test_text_only_chat_never_reaches_the_talker_or_code2wav(serve: Served) -> None:
    http = serve.http
    before = (await http.get("/metrics")).text
    resp = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, "max_tokens": 8})
    assert resp.status_code == 200
    assert resp.json()["choices"][0]["message"]["content"]
    assert resp.json()["choices"][0]["message"]["audio"] is None
    after = (await http.get("/metrics")).text
    assert stage_requests(after, "thinker") == stage_requests(before, "thinker") + 1
    for stage in ("talker", "code2wav"):
        assert stage_requests(after, stage) == stage_requests(before, stage)


@pytest.mark.slow
async def test_the_tiny_model_is_byte_identical_per_seed(tmp_path: Path, tiny_qwen3: Path) -> None:
    from omnimodel_runtime.tiny import build_tiny

    again = build_tiny(MODEL, tmp_path / "again", seed=0)
    other = build_tiny(MODEL, tmp_path / "other", seed=1)
    weights = "model.safetensors"
    assert (again / weights).read_bytes() == (tiny_qwen3 / weights).read_bytes() != (other / weights).read_bytes()
