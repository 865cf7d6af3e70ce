"""Chat with audio output on the omni preset, against fake stage engines shaped like the real ones:
what the client gets (WAV in ``message.audio``, SSE chunks naming their modality), what the stages are
asked (voice, chunking), and how bad input and failures look. The real engines: tests/component."""

from __future__ import annotations

import base64
import io
import json
import wave
from contextlib import AsyncExitStack

import httpx
import numpy as np
import openai
import pytest
from omni_fakes import RATE, WORDS, OmniServe, expected_waveform
from runtime_fakes import (
    asgi_client,
    lifespan,
    openai_client,
    serve_on_loopback,
    sse_events,
)

from omnimodel_runtime.settings import RuntimeSettings

USER = [{"role": "user", "content": "Say something."}]


async def test_openai_client_gets_text_and_a_wav_that_decodes(omni: OmniServe, omni_http: httpx.AsyncClient) -> None:
    client = openai_client(omni_http)
    reply = await client.chat.completions.create(
        model="qwen2.5-omni", messages=USER, modalities=["text", "audio"], audio={"voice": "Ethan", "format": "wav"}
    )
    message = reply.choices[0].message
    assert message.content == "".join(f" w{i}" for i in range(WORDS))
    assert message.audio is not None
    assert message.audio.transcript == message.content
    assert message.audio.expires_at > reply.created
    with wave.open(io.BytesIO(base64.b64decode(message.audio.data))) as wav:
        assert (wav.getframerate(), wav.getnchannels(), wav.getsampwidth()) == (RATE, 1, 2)
        samples = np.frombuffer(wav.readframes(wav.getnframes()), dtype="<i2")
    np.testing.assert_array_equal(samples, np.round(expected_waveform() * 32767).astype("<i2"))
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (3, WORDS)
    # The stages were asked for audio in Ethan's voice, computed whole (not chunked) for a whole answer.
    params = omni.code2wav.requests[0].request.params
    assert (params.voice, params.audio_chunked) == ("Ethan", False)


async def test_pcm16_format_returns_raw_samples(omni_http: httpx.AsyncClient) -> None:
    reply = await openai_client(omni_http).chat.completions.create(
        model="qwen2.5-omni", messages=USER, modalities=["audio"], audio={"voice": "Chelsie", "format": "pcm16"}
    )
    assert reply.choices[0].message.audio is not None
    raw = base64.b64decode(reply.choices[0].message.audio.data)
    np.testing.assert_array_equal(np.frombuffer(raw, "<i2"), np.round(expected_waveform() * 32767).astype("<i2"))


async def test_vllm_omni_speaker_names_the_voice(omni: OmniServe, omni_http: httpx.AsyncClient) -> None:
    body = {"model": "qwen2.5-omni", "messages": USER, "modalities": ["text", "audio"], "speaker": "Ethan"}
    assert (await omni_http.post("/v1/chat/completions", json=body)).status_code == 200
    assert omni.thinker.requests[-1].request.params.voice == "Ethan"
    # Naming two different voices is a mistake the client should hear about.
    body["audio"] = {"voice": "Chelsie"}
    resp = await omni_http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "speaker"


async def test_stream_names_each_chunk_and_audio_arrives_before_the_text_ends() -> None:
    # A real server on loopback: httpx's ASGI transport buffers whole responses, which would deadlock
    # on a thinker that waits for audio to reach the client.
    omni = OmniServe()
    async with AsyncExitStack() as stack:
        url = await serve_on_loopback(omni.app, stack)
        http = await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=30))
        await stream_and_check(omni, http)


async def stream_and_check(omni: OmniServe, http: httpx.AsyncClient) -> None:
    omni.thinker.go.clear()
    body = {
        "model": "qwen2.5-omni",
        "messages": USER,
        "modalities": ["text", "audio"],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events: list[str] = []
    async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
                chunk = json.loads(events[-1]) if events[-1] != "[DONE]" else {}
                if chunk.get("modality") == "audio":
                    # Only now may the thinker write its last word: audio must come first.
                    omni.thinker.go.set()
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["modality"] in ("text", "audio") for c in chunks)
    text_at = [i for i, c in enumerate(chunks) if c["choices"] and c["choices"][0]["delta"].get("content")]
    audio_at = [
        i for i, c in enumerate(chunks) if c["choices"] and (c["choices"][0]["delta"].get("audio") or {}).get("data")
    ]
    assert all(chunks[i]["modality"] == "audio" for i in audio_at)
    assert audio_at[0] < text_at[-1]
    pcm = b"".join(base64.b64decode(chunks[i]["choices"][0]["delta"]["audio"]["data"]) for i in audio_at)
    np.testing.assert_array_equal(np.frombuffer(pcm, "<i2"), np.round(expected_waveform() * 32767).astype("<i2"))
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [c["choices"][0]["finish_reason"] for c in finish] == ["stop"]
    assert chunks[-1]["usage"]["completion_tokens"] == WORDS
    # Streams are chunked on code2wav, so its first audio does not wait for the last code.
    assert omni.code2wav.requests[-1].request.params.audio_chunked is True


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"modalities": ["text", "audio"], "audio": {"voice": "Nobody"}}, "audio.voice"),
        ({"modalities": ["text", "video"]}, "modalities.1"),
        ({"modalities": ["text", "audio"], "audio": {"format": "mp3"}}, "audio.format"),
        ({"modalities": ["text", "audio"], "messages": []}, "messages"),
    ],
)
async def test_bad_input_is_a_400_envelope(omni_http: httpx.AsyncClient, body: dict[str, object], param: str) -> None:
    for stream in (False, True):
        resp = await omni_http.post(
            "/v1/chat/completions", json={"model": "qwen2.5-omni", "messages": USER, "stream": stream, **body}
        )
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert (error["type"], error["param"]) == ("invalid_request_error", param)


async def test_a_stage_failing_mid_stream_ends_with_an_error_chunk_and_done(omni_http: httpx.AsyncClient) -> None:
    body = {
        "model": "qwen2.5-omni",
        "messages": [{"role": "user", "content": "FAIL_AUDIO"}],
        "modalities": ["text", "audio"],
        "stream": True,
    }
    resp = await omni_http.post("/v1/chat/completions", json=body)
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["message"] == "vocoder exploded"


async def test_non_streamed_failure_is_an_error_envelope(omni_http: httpx.AsyncClient) -> None:
    client = openai_client(omni_http)
    with pytest.raises(openai.InternalServerError, match="vocoder exploded"):
        await client.chat.completions.create(
            model="qwen2.5-omni", messages=[{"role": "user", "content": "FAIL_AUDIO"}], modalities=["text", "audio"]
        )


# ---------------------------------------------------------------- vLLM-Omni's clients (docs/vllm-omni-compat.md)


@pytest.mark.parametrize(
    ("fields", "spoken"),
    [
        ({"audio": {"voice": "alloy", "format": "wav"}}, "Chelsie"),  # OpenAI's names: the default voice
        ({"audio": {"voice": "Shimmer"}}, "Chelsie"),
        ({"voice": "ethan"}, "Ethan"),  # vLLM-Omni reads top-level voice, case-insensitively
        ({"speaker": "ETHAN"}, "Ethan"),
        ({"audio": {"voice": "Ethan"}, "speaker": "ethan"}, "Ethan"),
        ({"voice": "default"}, "Chelsie"),
    ],
)
async def test_voice_names_of_openai_and_vllm_omni_clients_map_onto_the_speakers(
    omni_http: httpx.AsyncClient, omni: OmniServe, fields: dict[str, object], spoken: str
) -> None:
    body = {"model": "qwen2.5-omni", "messages": USER, "modalities": ["text", "audio"], **fields}
    resp = await omni_http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    assert omni.thinker.voices == [spoken]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"audio": {"voice": "Nobody"}}, "audio.voice"),
        ({"audio": {"voice": "Ethan"}, "voice": "Chelsie"}, "voice"),
        ({"voice": "Ethan", "speaker": "Chelsie"}, "speaker"),
    ],
)
async def test_an_unknown_or_contradictory_voice_is_a_400_listing_the_voices(
    omni_http: httpx.AsyncClient, fields: dict[str, object], param: str
) -> None:
    body = {"model": "qwen2.5-omni", "messages": USER, "modalities": ["text", "audio"], **fields}
    resp = await omni_http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param
    if param == "audio.voice":
        assert "Chelsie, Ethan" in error["message"]


async def test_modalities_left_out_answer_text_unless_configured_like_vllm_omni() -> None:
    # examples/online_serving/qwen2_5_omni/openai_chat_completion_client_for_multimodal_generation.py
    # leaves modalities out and extracts every choice's message.audio.
    body = {
        "model": "qwen2.5-omni",
        "messages": USER,
        "extra_body": {"sampling_params_list": [{"temperature": 0.0}, {"temperature": 0.9}, {"temperature": 0.0}]},
    }
    for configured, audio in ((None, False), (["text", "audio"], True)):
        settings = RuntimeSettings() if configured is None else RuntimeSettings(chat_default_modalities=configured)
        serve = OmniServe(settings)
        async with lifespan(serve.app), asgi_client(serve.app) as http:
            resp = await http.post("/v1/chat/completions", json=body)
            assert resp.status_code == 200, resp.text
            (choice,) = resp.json()["choices"]
            assert choice["message"]["content"] == "".join(f" w{i}" for i in range(WORDS))
            assert (choice["message"].get("audio") is not None) is audio
            assert bool(serve.code2wav.requests) is audio
            # A request that names its modalities gets those, whatever the default.
            resp = await http.post("/v1/chat/completions", json=body | {"modalities": ["text"]})
            assert resp.json()["choices"][0]["message"].get("audio") is None
