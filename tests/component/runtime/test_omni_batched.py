"""Qwen2.5-Omni's stages serving batched (``engine_args.batching``, the default on accelerators), on the tiny
model on the CPU: the same decode-slot and DiT-batching code the GPU runs, without CUDA graphs.

A lone greedy request still gives the whole model's text exactly and its waveform to within one step of
16-bit PCM (the slot decoder's attention sums in another order than Hugging Face's, in float32); requests
sent together run in shared decode steps and DiT passes and each gets what it gets alone.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import wave
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import pytest_asyncio
from runtime_procs import served_over_tcp
from test_omni_pipeline import CHUNKED_TOLERANCE, MODEL, USER, Whole

from omnimodel_runtime.serve import build_serve_app, serve_pipeline
from omnimodel_runtime.settings import RuntimeSettings

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

PROMPTS = ["Hello there, who are you?", "What is a pod?", "Tell me about the cluster.", "Why do engines batch?"]


def pcm(message: Mapping[str, Any]) -> np.ndarray:
    with wave.open(io.BytesIO(base64.b64decode(message["audio"]["data"]))) as w:
        return np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.int32)


def close_pcm(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.size > 0 and int(np.abs(a - b).max()) <= 1


def generated(metrics: str, stage: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(
        s.value
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
        if s.name == "omnimodel_generated_tokens_total" and s.labels.get("stage") == stage
    )


def batched_steps(metrics: str, stage: str) -> float:
    """Steps of ``stage`` that served more than one request (from the batch-size histogram)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = single = 0.0
    for family in text_string_to_metric_families(metrics):
        for s in family.samples:
            if s.labels.get("stage") != stage:
                continue
            if s.name == "omnimodel_batch_size_count":
                total = s.value
            elif s.name == "omnimodel_batch_size_bucket" and s.labels.get("le") == "1.0":
                single = s.value
    return total - single


@pytest.fixture(scope="module")
def tiny_omni(model_cache: Path) -> Path:
    from omnimodel_runtime.tiny import ensure_tiny

    return ensure_tiny(MODEL, model_cache)


@pytest.fixture(scope="module")
def whole(tiny_omni: Path) -> Whole:
    return Whole(tiny_omni)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def serve(tiny_omni: Path, model_cache: Path) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    settings = RuntimeSettings(model_cache=model_cache, device="cpu")
    pipeline = serve_pipeline(
        MODEL, f"tiny://{MODEL}", device="cpu", engine_args={"batching": True, "max_batch_size": 4}
    )
    app = build_serve_app(settings, pipeline)
    async with app.router.lifespan_context(app):
        await app.state.startup.wait()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=300) as http:
            yield app, http


def body(prompt: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "modalities": ["text", "audio"],
        "max_tokens": 24,
        "temperature": 0,
        "seed": 5,
        **extra,
    }


async def test_the_stages_serve_batched(serve: tuple[Any, httpx.AsyncClient]) -> None:
    app, _ = serve
    engines = [app.state.orchestrator.handles[name].engine for name in ("thinker", "talker", "code2wav")]
    assert all(engine.batched for engine in engines)


async def test_a_lone_greedy_request_gets_the_whole_models_text_and_waveform(
    serve: tuple[Any, httpx.AsyncClient], whole: Whole
) -> None:
    _, http = serve
    resp = await http.post("/v1/chat/completions", json={**body(""), "messages": USER})
    assert resp.status_code == 200, resp.text
    message = resp.json()["choices"][0]["message"]
    text, wav = whole.generate(USER, speaker="Chelsie", max_tokens=24, seed=5)
    assert message["content"] == text
    with wave.open(io.BytesIO(wav)) as w:
        expected = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.int32)
    assert close_pcm(pcm(message), expected)


async def test_requests_sent_together_share_steps_and_each_gets_what_it_gets_alone(
    serve: tuple[Any, httpx.AsyncClient],
) -> None:
    _, http = serve
    alone = []
    for prompt in PROMPTS:
        resp = await http.post("/v1/chat/completions", json=body(prompt))
        alone.append(resp.json()["choices"][0]["message"])
    before = (await http.get("/metrics")).text
    together = await asyncio.gather(*(http.post("/v1/chat/completions", json=body(p)) for p in PROMPTS))
    after = (await http.get("/metrics")).text
    for single, resp in zip(alone, together, strict=True):
        assert resp.status_code == 200, resp.text
        message = resp.json()["choices"][0]["message"]
        assert message["content"] == single["content"]
        assert close_pcm(pcm(message), pcm(single))
    for stage in ("thinker", "talker"):
        assert batched_steps(after, stage) > batched_steps(before, stage), stage


async def test_streams_sent_together_get_their_audio_in_chunks(serve: tuple[Any, httpx.AsyncClient]) -> None:
    _, http = serve
    resps = await asyncio.gather(
        *(http.post("/v1/chat/completions", json=body(p, stream=True, max_tokens=64)) for p in PROMPTS)
    )
    for resp in resps:
        assert resp.status_code == 200
        events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        audio = [
            c["choices"][0]["delta"]["audio"]["data"]
            for c in chunks
            if c["choices"] and (c["choices"][0]["delta"].get("audio") or {}).get("data")
        ]
        assert len(audio) >= 2
        samples = np.frombuffer(b"".join(base64.b64decode(a) for a in audio), dtype="<i2")
        assert float(np.sqrt(np.mean((samples / 32767.0) ** 2))) > 0.01


async def test_chunks_of_several_streams_in_one_dit_pass_match_one_pass_over_the_same_noise(
    serve: tuple[Any, httpx.AsyncClient],
) -> None:
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

    app, http = serve
    engine = app.state.orchestrator.handles["code2wav"].engine
    gen = torch.Generator().manual_seed(0)
    streams = [torch.randint(0, 64, (100,), generator=gen).numpy() for _ in range(3)]

    async def talker(codes: np.ndarray) -> AsyncIterator[Any]:
        for i in range(0, len(codes), 5):  # codes trickle in, as the talker samples them
            yield tensor_frame(CODES_KIND, {"codes": codes[i : i + 5]})
            await asyncio.sleep(0)
        yield FinalFrame("stop")

    async def chunked(i: int, codes: np.ndarray) -> np.ndarray:
        request = StageRequest(
            request_id=f"chunked-{i}",
            prompt="",
            sampling=SamplingParams(seed=7 + i),
            params=StageParams(audio_chunked=True, voice="Chelsie"),
        )
        pieces = [
            f.tensors["audio"]
            async for f in engine.generate(StageInput(request=request, upstream=talker(codes)))
            if isinstance(f, TensorFrame)
        ]
        assert len(pieces) >= 2
        return np.concatenate(pieces)

    before = (await http.get("/metrics")).text
    results = await asyncio.gather(*(chunked(i, codes) for i, codes in enumerate(streams)))
    after = (await http.get("/metrics")).text
    assert batched_steps(after, "code2wav") > batched_steps(before, "code2wav")
    dit, speaker = engine.model.code2wav_dit_model, engine.speakers["Chelsie"]
    for i, (codes, got) in enumerate(zip(streams, results, strict=True)):
        frames = len(codes) * int(dit.repeats)
        noise = PagedNoise(7 + i, int(dit.config.block_size), int(dit.mel_dim), "cpu").frames(0, frames)
        with torch.inference_mode():
            mel = sample_mel(
                dit,
                speaker["cond"].float().reshape(1, -1),
                speaker["ref_mel"].float(),
                torch.from_numpy(codes).unsqueeze(0),
                noise,
            )
            single = engine.model.code2wav_bigvgan_model(mel).reshape(-1).numpy()
        assert got.shape == single.shape
        assert float(np.abs(got - single).max()) < CHUNKED_TOLERANCE


async def test_a_client_going_away_frees_every_stage(serve: tuple[Any, httpx.AsyncClient]) -> None:
    """A real TCP client hangs up after the first text delta of a long answer: every stage drops the
    request (its slot, its chunks) long before the thousands of thinker steps it asked for."""
    app, http = serve
    engines = [app.state.orchestrator.handles[name].engine for name in ("thinker", "talker", "code2wav")]
    long = body("Talk for a long time.", stream=True, max_tokens=4000, ignore_eos=True)
    before = generated((await http.get("/metrics")).text, "thinker")
    loop = asyncio.get_running_loop()
    async with served_over_tcp(app) as url:
        async with (
            httpx.AsyncClient(base_url=url, timeout=60) as client,
            client.stream("POST", "/v1/chat/completions", json=long) as resp,
        ):
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                    break  # the thinker is writing
        left = loop.time()
        assert any(engine.busy for engine in engines)
        while any(engine.busy for engine in engines):
            assert loop.time() < left + 5, "a stage kept working for a client that went away"
            await asyncio.sleep(0.05)
    thinker = app.state.orchestrator.handles["thinker"].engine
    assert thinker._slots is not None
    assert not thinker._slots.holders
    # Stopped, not finished: far fewer thinker tokens than the 4000 asked for.
    assert generated((await http.get("/metrics")).text, "thinker") - before < 3000


async def test_a_request_with_audio_and_an_image_runs_whole_through_generate_beside_the_batch(
    serve: tuple[Any, httpx.AsyncClient], whole: Whole
) -> None:
    """The slot decoder does not carry the M-RoPE shift of media: such a request takes the one-at-a-time
    path inside the batched thinker, so its text is the whole model's exactly, while a text request sent
    with it still gets what it gets alone."""
    from test_omni_inputs import audio_part, image_part, png_file, wav_file, whole_generate

    _, http = serve
    content = [audio_part(wav_file(1)), image_part(png_file()), {"type": "text", "text": "What is this?"}]
    media = {**body(""), "messages": [{"role": "user", "content": content}], "modalities": ["text"]}
    alone = await http.post("/v1/chat/completions", json=body("Count to ten.", modalities=["text"]))
    both = await asyncio.gather(
        http.post("/v1/chat/completions", json=media),
        http.post("/v1/chat/completions", json=body("Count to ten.", modalities=["text"])),
    )
    assert all(r.status_code == 200 for r in (alone, *both)), [r.text for r in both]
    text, _ = whole_generate(whole, content, speaker="Chelsie", max_tokens=24, seed=5, speech=False)
    assert both[0].json()["choices"][0]["message"]["content"] == text
    assert both[1].json()["choices"][0]["message"]["content"] == alone.json()["choices"][0]["message"]["content"]
