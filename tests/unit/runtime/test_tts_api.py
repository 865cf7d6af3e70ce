"""``/v1/audio/speech`` and ``/v1/audio/voices`` through the official ``openai`` client over ASGI, with fake
acoustic and vocoder engines behind the ``tts`` preset (the real engines are in tests/component)."""

from __future__ import annotations

import io
import math
import wave
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf
from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from runtime_fakes import asgi_client, fake_context, lifespan, openai_client, serve_on_loopback

from omnimodel_runtime.engines.base import Engine
from omnimodel_runtime.errors import StageError
from omnimodel_runtime.gateway import build_app
from omnimodel_runtime.metrics import StageMetricsFamily
from omnimodel_runtime.protocol.speech import resolve_voice
from omnimodel_runtime.protocol.stage import FinalFrame, ResponseFrame, StageInput, StageParams, TensorFrame, Usage
from omnimodel_runtime.serve import serve_pipeline
from omnimodel_runtime.settings import RuntimeSettings
from omnimodel_runtime.stage.handle import StageHandle
from omnimodel_runtime.stage.local import LocalStage
from omnimodel_runtime.stage.remote import RemoteStage
from omnimodel_runtime.stage.server import build_stage_app

RATE = 8000
# What OpenAI's clients play raw pcm at (16-bit mono little-endian).
OPENAI_PCM_RATE = 24000
HOP = 4
BINS = 3


def mel_of(text: str) -> np.ndarray:
    """The fake acoustic model: 4 frames per character, values from the character codes."""
    codes = np.repeat(np.array([ord(c) for c in text], dtype=np.float32), 4)
    return np.stack([np.sin(codes + k) for k in range(BINS)], axis=1).astype(np.float32)


def audio_of(mel: np.ndarray) -> np.ndarray:
    """The fake vocoder: HOP samples per frame."""
    return np.repeat(mel[:, 0] * 0.5, HOP).astype(np.float32)


class FakeAcoustic(Engine):
    """Speaks ``mel_of(text)`` in chunks of 8 frames; knows the voices ``default`` and ``alto``."""

    async def start(self) -> None:
        self.requests: list[StageInput] = []

    async def stop(self) -> None:
        pass

    async def generate(self, inp: StageInput) -> AsyncIterator[ResponseFrame]:
        request = inp.request
        if request.params.query == "voices":
            yield TensorFrame({}, meta={"voices": ["alto", "default"], "default": "default"})
            yield FinalFrame("stop")
            return
        self.requests.append(inp)
        if request.params.voice not in ("default", "alto"):
            raise StageError(f"unknown voice {request.params.voice!r}", status=400, param="voice")
        text = request.prompt or ""
        mel = mel_of(text)
        for start in range(0, len(mel), 8):
            yield TensorFrame({"mel": mel[start : start + 8]}, meta={"start": start})
            if "FAIL_AFTER" in text:
                raise StageError("the acoustic model exploded", status=500)
        yield FinalFrame("length", Usage(prompt_tokens=len(text), completion_tokens=len(mel)))


class FakeVocoder(Engine):
    """Vocodes each mel chunk as it arrives when streaming, the whole mel at the end otherwise."""

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def generate(self, inp: StageInput) -> AsyncIterator[ResponseFrame]:
        assert inp.upstream is not None
        whole: list[np.ndarray] = []
        async for frame in inp.upstream:
            if isinstance(frame, TensorFrame):
                if inp.request.stream:
                    yield TensorFrame({"audio": audio_of(frame.tensors["mel"])}, meta={"sample_rate": RATE})
                else:
                    whole.append(frame.tensors["mel"])
        if whole:
            yield TensorFrame({"audio": audio_of(np.concatenate(whole))}, meta={"sample_rate": RATE})
        yield FinalFrame("stop")


def tts_app() -> tuple[FastAPI, FakeAcoustic]:
    pipeline = serve_pipeline("tts", "tiny://tts", device="cpu")
    family = StageMetricsFamily(CollectorRegistry())
    acoustic = FakeAcoustic(fake_context(pipeline.stage("acoustic")))
    vocoder = FakeVocoder(fake_context(pipeline.stage("vocoder")))
    handles: dict[str, StageHandle] = {
        "acoustic": LocalStage(pipeline.stage("acoustic"), acoustic, family.for_stage("acoustic")),
        "vocoder": LocalStage(pipeline.stage("vocoder"), vocoder, family.for_stage("vocoder")),
    }
    return build_app(RuntimeSettings(), pipeline, handles), acoustic


@pytest.fixture
async def tts() -> AsyncIterator[tuple[httpx.AsyncClient, FakeAcoustic]]:
    app, acoustic = tts_app()
    async with lifespan(app), asgi_client(app) as http:
        yield http, acoustic


def pcm(samples: np.ndarray) -> np.ndarray:
    return (np.clip(samples, -1, 1) * 32767).round().astype("<i2")


async def test_speech_returns_a_wav_file_with_the_pipeline_audio(tts: tuple[httpx.AsyncClient, FakeAcoustic]) -> None:
    http, acoustic = tts
    client = openai_client(http)
    resp = await client.audio.speech.create(model="tts", voice="alto", input="Hello", speed=1.5)
    assert resp.response.headers["content-type"] == "audio/wav"
    assert resp.response.headers["x-sample-rate"] == str(RATE)
    with wave.open(io.BytesIO(resp.content)) as wav:
        assert (wav.getframerate(), wav.getnchannels(), wav.getsampwidth()) == (RATE, 1, 2)
        samples = np.frombuffer(wav.readframes(wav.getnframes()), "<i2")
    np.testing.assert_array_equal(samples, pcm(audio_of(mel_of("Hello"))))
    (inp,) = acoustic.requests
    assert inp.request.prompt == "Hello"
    assert inp.request.params == StageParams(voice="alto", speed=1.5)
    assert inp.request.stream is False


async def test_streamed_pcm_has_the_sample_rate_header_and_equals_the_whole_response(
    tts: tuple[httpx.AsyncClient, FakeAcoustic],
) -> None:
    http, _ = tts
    client = openai_client(http)
    whole = await client.audio.speech.create(model="tts", voice="default", input="Hi there", response_format="pcm")
    async with client.audio.speech.with_streaming_response.create(
        model="tts", voice="default", input="Hi there", extra_body={"stream": True}
    ) as streamed:
        assert streamed.headers["content-type"] == "audio/pcm"
        assert streamed.headers["x-sample-rate"] == str(OPENAI_PCM_RATE)
        body = b"".join([chunk async for chunk in streamed.iter_bytes()])
    assert body == whole.content
    assert len(body) == 2 * math.ceil(HOP * len(mel_of("Hi there")) * OPENAI_PCM_RATE / RATE)


async def test_pcm_is_openais_24_khz_and_lasts_as_long_as_the_wav(tts: tuple[httpx.AsyncClient, FakeAcoustic]) -> None:
    """An OpenAI client plays pcm as 24 kHz 16-bit mono: read so, it lasts as long as the wav of the same
    audio (whose header states the model's rate) and follows the same waveform."""
    client = openai_client(tts[0])
    text = "A sentence of some length"
    wav = await client.audio.speech.create(model="tts", voice="default", input=text, response_format="wav")
    pcm_response = await client.audio.speech.create(model="tts", voice="default", input=text, response_format="pcm")
    with wave.open(io.BytesIO(wav.content)) as file:
        wav_rate = file.getframerate()
        wav_samples = np.frombuffer(file.readframes(file.getnframes()), "<i2").astype(np.float64)
    pcm_samples = np.frombuffer(pcm_response.content, "<i2").astype(np.float64)
    assert wav_rate == RATE != OPENAI_PCM_RATE
    assert abs(len(pcm_samples) / OPENAI_PCM_RATE - len(wav_samples) / wav_rate) <= 1 / OPENAI_PCM_RATE
    assert pcm_response.response.headers["x-sample-rate"] == str(OPENAI_PCM_RATE)
    # The same waveform: the pcm read at 24 kHz, taken at the wav's sample times, is the wav.
    pcm_times = np.arange(len(pcm_samples)) / OPENAI_PCM_RATE
    at_wav_times = np.interp(np.arange(len(wav_samples)) / wav_rate, pcm_times, pcm_samples)
    assert np.corrcoef(at_wav_times, wav_samples)[0, 1] > 0.99


async def test_stream_format_audio_streams_like_stream_true(tts: tuple[httpx.AsyncClient, FakeAcoustic]) -> None:
    http, acoustic = tts
    resp = await http.post("/v1/audio/speech", json={"input": "abc", "stream_format": "audio"})
    assert resp.status_code == 200
    assert resp.headers["content-type"] == "audio/pcm"
    assert acoustic.requests[-1].request.stream is True


async def test_flac_decodes_to_the_same_samples_as_wav(tts: tuple[httpx.AsyncClient, FakeAcoustic]) -> None:
    http, _ = tts
    client = openai_client(http)
    flac = await client.audio.speech.create(model="tts", voice="default", input="Flac", response_format="flac")
    assert flac.response.headers["content-type"] == "audio/flac"
    data, rate = sf.read(io.BytesIO(flac.content), dtype="int16")
    assert rate == RATE
    np.testing.assert_array_equal(data, pcm(audio_of(mel_of("Flac"))))


async def test_voices_lists_what_the_acoustic_stage_ships(tts: tuple[httpx.AsyncClient, FakeAcoustic]) -> None:
    http, _ = tts
    resp = await http.get("/v1/audio/voices")
    assert resp.status_code == 200
    assert resp.json() == {"voices": ["alto", "default"], "default": "default"}


async def test_voices_of_a_stage_process_come_from_its_stage_info_not_a_generation() -> None:
    """The gateway of ``omnimodel gateway`` asks the acoustic stage's ``/v1/stage/info``: the stage runs
    no request for it (its request counter stays at zero) and the list is the same."""
    pipeline = serve_pipeline("tts", "tiny://tts", device="cpu")
    settings = RuntimeSettings(health_interval=3600)
    acoustic = pipeline.stage("acoustic")
    stage_app = build_stage_app(settings, pipeline, "acoustic", engine=FakeAcoustic(fake_context(acoustic)))
    async with AsyncExitStack() as stack:
        url = await serve_on_loopback(stage_app, stack)
        vocoder = FakeVocoder(fake_context(pipeline.stage("vocoder")))
        family = StageMetricsFamily(CollectorRegistry())
        handles: dict[str, StageHandle] = {
            "acoustic": RemoteStage(acoustic, settings, endpoints=(url,)),
            "vocoder": LocalStage(pipeline.stage("vocoder"), vocoder, family.for_stage("vocoder")),
        }
        gateway = build_app(settings, pipeline, handles)
        await stack.enter_async_context(lifespan(gateway))
        http = await stack.enter_async_context(asgi_client(gateway))
        resp = await http.get("/v1/audio/voices")
        assert resp.status_code == 200, resp.text
        assert resp.json() == {"voices": ["alto", "default"], "default": "default"}
        async with httpx.AsyncClient(base_url=url) as stage_http:
            info = (await stage_http.get("/v1/stage/info")).json()
            assert info["voices"] == {"names": ["alto", "default"], "default": "default"}
            metrics = (await stage_http.get("/metrics")).text
        assert 'omnimodel_stage_requests_total{outcome="ok",stage="acoustic"}' not in metrics


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({"input": ""}, "input", "at least 1 character"),
        ({"input": "   "}, "input", "must contain text"),
        ({"input": "x" * 4097}, "input", "at most 4096"),
        ({"input": "hi", "voice": "nobody"}, "voice", "unknown voice 'nobody'"),
        ({"input": "hi", "voice": {"id": "nobody"}}, "voice", "unknown voice 'nobody'"),
        ({"input": "hi", "response_format": "aac"}, "response_format", "'aac' is not supported"),
        ({"input": "hi", "response_format": "ogg"}, "response_format", "Input should be"),
        ({"input": "hi", "speed": 4.5}, "speed", "less than or equal to 4"),
        ({"input": "hi", "speed": 0.1}, "speed", "greater than or equal to 0.25"),
        ({"input": "hi", "stream": True, "response_format": "wav"}, "response_format", "cannot be streamed"),
        ({"input": "hi", "stream_format": "sse"}, "stream_format", "not supported"),
        ({"input": "hi", "instructions": "whisper"}, "instructions", "not supported"),
    ],
)
async def test_bad_speech_requests_get_a_400_envelope_naming_the_field(
    tts: tuple[httpx.AsyncClient, FakeAcoustic], body: dict[str, object], param: str, fragment: str
) -> None:
    http, _ = tts
    resp = await http.post("/v1/audio/speech", json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert fragment in error["message"]


async def test_unknown_voice_through_the_client_raises_bad_request(
    tts: tuple[httpx.AsyncClient, FakeAcoustic],
) -> None:
    client = openai_client(tts[0])
    with pytest.raises(openai.BadRequestError, match="unknown voice"):
        await client.audio.speech.create(model="tts", voice="nobody", input="hi")
    with pytest.raises(openai.BadRequestError, match="unknown voice"):
        async with client.audio.speech.with_streaming_response.create(
            model="tts", voice="nobody", input="hi", extra_body={"stream": True}
        ):
            pass


async def test_wrong_model_is_a_404(tts: tuple[httpx.AsyncClient, FakeAcoustic]) -> None:
    client = openai_client(tts[0])
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        await client.audio.speech.create(model="tts-1", voice="default", input="hi")


async def test_a_failure_after_the_first_bytes_cuts_the_stream_short() -> None:
    app, _ = tts_app()
    received: list[bytes] = []

    async def read(http: httpx.AsyncClient, text: str) -> None:
        async with http.stream("POST", "/v1/audio/speech", json={"input": text, "stream": True}) as resp:
            assert resp.status_code == 200
            async for chunk in resp.aiter_raw():
                received.append(chunk)

    async with AsyncExitStack() as stack:
        url = await serve_on_loopback(app, stack)
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            await read(http, "A whole utterance")
            # Streamed as produced: one HTTP chunk per vocoded mel chunk (then the resampler's last few
            # samples), not one body at the end.
            assert len(received) == len(range(0, len(mel_of("A whole utterance")), 8)) + 1
            received.clear()
            # A raw PCM body has no room for an error envelope: the client sees an incomplete body.
            with pytest.raises(httpx.RemoteProtocolError):
                await read(http, "FAIL_AFTER the first chunk")
    assert 0 < len(b"".join(received)) < 2 * HOP * len(mel_of("FAIL_AFTER the first chunk")) * OPENAI_PCM_RATE // RATE


async def test_speech_routes_exist_only_where_the_pipeline_serves_speech(
    tts: tuple[httpx.AsyncClient, FakeAcoustic], http: httpx.AsyncClient
) -> None:
    speech_http, _ = tts
    # The text preset serves chat, not speech; the tts preset the other way round.
    assert (await http.post("/v1/audio/speech", json={"input": "hi"})).status_code == 404
    assert (await http.get("/v1/audio/voices")).status_code == 404
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert (await speech_http.post("/v1/chat/completions", json=chat)).status_code == 404


@pytest.mark.parametrize("seed", [2**64, 2**63, -(2**63) - 1])
async def test_a_seed_no_generator_takes_is_a_400_naming_it(
    tts: tuple[httpx.AsyncClient, FakeAcoustic], seed: int
) -> None:
    http, acoustic = tts
    resp = await http.post("/v1/audio/speech", json={"model": "tts", "input": "Hi", "seed": seed})
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "seed"
    assert acoustic.requests == []
    ok = await http.post("/v1/audio/speech", json={"model": "tts", "input": "Hi", "seed": 2**63 - 1})
    assert ok.status_code == 200


@pytest.mark.parametrize(
    ("voice", "spoken"),
    [(None, "default"), ("default", "default"), ("Alloy", "default"), ("nova", "default"), ("Lisa", "lisa")],
)
def test_openai_and_vllm_omni_voice_names_resolve_onto_the_speakers(voice: str | None, spoken: str) -> None:
    assert resolve_voice(voice, ["default", "lisa"], "default", param="voice") == spoken


def test_an_unknown_voice_lists_the_voices() -> None:
    with pytest.raises(StageError, match="speaks with: default, lisa") as err:
        resolve_voice("bob", ["default", "lisa"], "default", param="voice")
    assert (err.value.status, err.value.param) == (400, "voice")
