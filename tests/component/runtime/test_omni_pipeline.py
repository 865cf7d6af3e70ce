"""Qwen2.5-Omni split into thinker -> talker -> code2wav stages (in process, ``serve``-shaped), on the tiny
random-weight model, against the whole model's own ``generate()``.

The equality is exact: the text, and the WAV the client receives is byte for byte the whole model's
waveform in 16-bit PCM (same seed, same input; greedy thinker, sampling talker). Streamed answers run
code2wav chunked; its audio equals a single pass over the same noise within :data:`CHUNKED_TOLERANCE`.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import pytest_asyncio
from runtime_procs import served_over_tcp, stage_requests, wav_of

from omnimodel_runtime.serve import build_serve_app, serve_pipeline
from omnimodel_runtime.serving.audio import wav_bytes
from omnimodel_runtime.settings import RuntimeSettings

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

MODEL = "qwen2.5-omni"
USER = [{"role": "user", "content": "Hello there, who are you and what can you do?"}]
# Max abs difference between chunked and single-pass audio from the same noise (measured: ~2e-7).
CHUNKED_TOLERANCE = 1e-5


@dataclass
class Whole:
    """The unsplit ``Qwen2_5OmniForConditionalGeneration`` loaded from the same checkpoint."""

    model_dir: Path

    @cached_property
    def model(self) -> Any:
        from transformers import Qwen2_5OmniForConditionalGeneration

        return Qwen2_5OmniForConditionalGeneration.from_pretrained(self.model_dir).eval()

    @cached_property
    def tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.model_dir)

    def generate(
        self, messages: list[Mapping[str, str]], *, speaker: str, max_tokens: int, seed: int, threads: int | None = None
    ) -> tuple[str, bytes]:
        """The whole model's text and its waveform as the WAV file a client would get. ``threads``: the
        torch thread count of the stages compared against (CPU kernels sum in an order that depends on
        it, so bit-equality needs the same count)."""
        import torch

        if threads is not None:
            previous = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                return self.generate(messages, speaker=speaker, max_tokens=max_tokens, seed=seed)
            finally:
                torch.set_num_threads(previous)
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        inputs = self.tokenizer(text, return_tensors="pt", add_special_tokens=False)
        talker = self.model.talker
        generation = json.loads((self.model_dir / "omni_generation_config.json").read_text())["talker"]
        torch.manual_seed(seed)
        sequences, waveform = self.model.generate(
            **inputs,
            speaker=speaker,
            thinker_max_new_tokens=max_tokens,
            thinker_do_sample=False,
            talker_max_new_tokens=generation["max_new_tokens"],
            # The defaults are the released vocabulary's ids; a tiny vocabulary needs its own.
            talker_eos_token_id=[talker.codec_pad_token, talker.codec_eos_token],
        )
        reply = self.tokenizer.decode(sequences[0, inputs.input_ids.shape[1] :], skip_special_tokens=True)
        return reply, wav_bytes(waveform.numpy(), 24000)


@pytest.fixture(scope="module")
def tiny_omni(model_cache: Path) -> Path:
    from omnimodel_runtime.tiny import ensure_tiny

    return ensure_tiny(MODEL, model_cache)


@pytest.fixture(scope="module")
def whole(tiny_omni: Path) -> Whole:
    return Whole(tiny_omni)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def serve(tiny_omni: Path, model_cache: Path) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    """The ``omnimodel serve`` app: every stage in this process, frames handed over in memory."""
    settings = RuntimeSettings(model_cache=model_cache, device="cpu")
    app = build_serve_app(settings, serve_pipeline(MODEL, f"tiny://{MODEL}", device="cpu"))
    async with app.router.lifespan_context(app):
        await app.state.startup.wait()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=120) as http:
            yield app, http


async def test_split_stages_reproduce_the_whole_model_text_and_waveform(
    serve: tuple[Any, httpx.AsyncClient], whole: Whole
) -> None:
    _, http = serve
    # The official client, with OpenAI's audio.voice.
    client = openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="unused", http_client=http, max_retries=0)
    reply = await client.chat.completions.create(
        model=MODEL,
        messages=USER,  # type: ignore[arg-type]
        modalities=["text", "audio"],
        audio={"voice": "Chelsie", "format": "wav"},
        max_tokens=24,
        temperature=0,
        seed=5,
    )
    assert reply.choices[0].message.audio is not None
    text, wav = whole.generate(USER, speaker="Chelsie", max_tokens=24, seed=5)
    assert reply.choices[0].message.content == text
    assert reply.choices[0].message.audio.transcript == text
    assert wav_of(reply.choices[0].message.model_dump()) == wav
    # vLLM-Omni's speaker picks from the same speaker map: another voice, another (still exact) waveform.
    body = {"model": MODEL, "messages": USER, "modalities": ["text", "audio"], "max_tokens": 24, "temperature": 0}
    resp = await http.post("/v1/chat/completions", json={**body, "seed": 5, "speaker": "Ethan"})
    assert resp.status_code == 200, resp.text
    text, ethan = whole.generate(USER, speaker="Ethan", max_tokens=24, seed=5)
    assert resp.json()["choices"][0]["message"]["content"] == text
    assert wav_of(resp.json()["choices"][0]["message"]) == ethan != wav


async def test_vllm_omni_client_voice_names_reach_the_speaker_map(serve: tuple[Any, httpx.AsyncClient]) -> None:
    _, http = serve
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


async def test_streamed_audio_starts_before_the_text_ends(serve: tuple[Any, httpx.AsyncClient]) -> None:
    _, http = serve
    body = {
        "model": MODEL,
        "messages": USER,
        "modalities": ["text", "audio"],
        "stream": True,
        # Long enough that the talker has its first chunk of codes long before the thinker is done: the
        # first audio comes after 200-450 thinker tokens on two loaded CPU cores (400 lost that race).
        "max_tokens": 2000,
        "ignore_eos": True,
        "temperature": 0,
    }
    resp = await http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200
    events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    deltas = [(c["modality"], c["choices"][0]["delta"]) for c in chunks if c["choices"]]
    text_at = [i for i, (_, d) in enumerate(deltas) if d.get("content")]
    audio_at = [i for i, (m, d) in enumerate(deltas) if m == "audio" and (d.get("audio") or {}).get("data")]
    assert len(audio_at) >= 2  # chunked: more than one piece
    assert audio_at[0] < text_at[-1]
    pcm = b"".join(base64.b64decode(deltas[i][1]["audio"]["data"]) for i in audio_at)
    samples = np.frombuffer(pcm, dtype="<i2")
    assert samples.size > 0
    assert float(np.sqrt(np.mean((samples / 32767.0) ** 2))) > 0.01  # audible, not silence


async def test_text_only_chat_never_reaches_the_talker_or_code2wav(serve: tuple[Any, httpx.AsyncClient]) -> None:
    _, http = serve
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


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"audio": {"voice": "Nobody"}}, "audio.voice"),
        ({"speaker": "Nobody"}, "audio.voice"),
        ({"modalities": ["text", "video"]}, "modalities.1"),
        ({"messages": []}, "messages"),
    ],
)
async def test_bad_input_gets_a_4xx_envelope(
    serve: tuple[Any, httpx.AsyncClient], extra: dict[str, Any], param: str
) -> None:
    _, http = serve
    for stream in (False, True):
        body = {"model": MODEL, "messages": USER, "modalities": ["text", "audio"], "stream": stream, **extra}
        resp = await http.post("/v1/chat/completions", json=body)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == param


async def test_chunked_code2wav_matches_one_pass_over_the_same_noise(serve: tuple[Any, httpx.AsyncClient]) -> None:
    import torch

    from omnimodel_runtime.engines.omni.code2wav import PagedNoise, sample_mel
    from omnimodel_runtime.engines.omni.common import CODES_KIND, tensor_frame
    from omnimodel_runtime.protocol.stage import (
        FinalFrame,
        SamplingParams,
        StageInput,
        StageParams,
        StageRequest,
        TensorFrame,
    )

    app, _ = serve
    engine = app.state.orchestrator.handles["code2wav"].engine
    codes = torch.randint(0, 64, (100,), generator=torch.Generator().manual_seed(0)).numpy()

    async def talker() -> AsyncIterator[Any]:
        for i in range(0, len(codes), 5):  # codes trickle in, as the talker samples them
            yield tensor_frame(CODES_KIND, {"codes": codes[i : i + 5]})
        yield FinalFrame("stop")

    request = StageRequest(
        request_id="chunked",
        prompt="",
        sampling=SamplingParams(seed=7),
        params=StageParams(audio_chunked=True, voice="Chelsie"),
    )
    pieces = [
        f.tensors["audio"]
        async for f in engine.generate(StageInput(request=request, upstream=talker()))
        if isinstance(f, TensorFrame)
    ]
    assert len(pieces) > 2
    chunked = np.concatenate(pieces)

    dit, speaker = engine.model.code2wav_dit_model, engine.speakers["Chelsie"]
    frames = len(codes) * int(dit.repeats)
    noise = PagedNoise(7, int(dit.config.block_size), int(dit.mel_dim), "cpu").frames(0, frames)
    with torch.inference_mode():
        mel = sample_mel(
            dit,
            speaker["cond"].float().reshape(1, -1),
            speaker["ref_mel"].float(),
            torch.from_numpy(codes).unsqueeze(0),
            noise,
        )
        single = engine.model.code2wav_bigvgan_model(mel).reshape(-1).numpy()
    assert chunked.shape == single.shape == (frames * 240,)
    assert float(np.abs(chunked - single).max()) < CHUNKED_TOLERANCE


async def test_a_client_going_away_stops_every_stage(
    serve: tuple[Any, httpx.AsyncClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real HTTP client of the gateway (TCP, not ASGI in memory) asks for a long spoken answer, reads
    its first text delta and hangs up: the worker of every stage ends that request as cancelled, long
    before the thousands of thinker steps it asked for."""
    from omnimodel_runtime.engines.worker import CancelledRequestError

    app, _ = serve
    engines = {name: app.state.orchestrator.handles[name].engine for name in ("thinker", "talker", "code2wav")}
    cancelled: dict[str, list[str]] = {name: [] for name in engines}
    for name, engine in engines.items():

        def run(job: Any, *, _run: Any = engine.run, _name: str = name) -> None:
            try:
                _run(job)
            except CancelledRequestError:
                cancelled[_name].append(job.request.request_id)
                raise

        monkeypatch.setattr(engine, "run", run)

    body = {
        "model": MODEL,
        "messages": USER,
        "modalities": ["text", "audio"],
        "stream": True,
        # Thousands of thinker steps: far longer than the deadline below, unless the request is aborted.
        "max_tokens": 4000,
        "ignore_eos": True,
        "temperature": 0,
    }
    async with served_over_tcp(app) as url:
        async with (
            httpx.AsyncClient(base_url=url, timeout=60) as client,
            client.stream("POST", "/v1/chat/completions", json=body) as resp,
        ):
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                    break  # the thinker is writing; its talker and code2wav have their jobs running
        # Leaving the stream unread closed its connection: the gateway sees the client disconnect.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while not all(cancelled.values()) or any(engine.busy for engine in engines.values()):
            assert loop.time() < deadline, f"a stage kept working for a client that went away (cancelled: {cancelled})"
            await asyncio.sleep(0.05)
    # One request, the same one, everywhere.
    assert len({tuple(ids) for ids in cancelled.values()}) == 1
    assert all(len(ids) == 1 for ids in cancelled.values())
