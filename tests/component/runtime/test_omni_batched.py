"""Qwen2.5-Omni's stages serving batched (``engine_args.batching``, the default on accelerators), on the tiny
model on the CPU: the same decode-slot and DiT-batching code the GPU runs, without CUDA graphs.

A lone greedy request still gives the whole model's text exactly and its waveform to within one step of
16-bit PCM (the slot decoder's attention sums in another order than Hugging Face's, in float32); requests
sent together run in shared decode steps, DiT passes and vocoder passes and each gets what it gets alone.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
import torch
from omni_helpers import (
    BATCH_PROMPTS,
    CHUNKED_TOLERANCE,
    QWEN25,
    USER,
    Qwen25Whole,
    alone_and_together,
    audio_part,
    batched_steps,
    chat_body,
    chunked_code2wav,
    code2wav_one_pass,
    image_part,
    png_file,
    wav_file,
)
from runtime_procs import (
    Served,
    hang_up_after_the_first_text,
    metric_total,
    served_in_process,
    served_over_tcp,
    sse_chunks,
    streamed_audio,
    wav_samples,
)

from omnimodel_runtime.engines.devices import sdpa_backends
from omnimodel_runtime.engines.omni.common import (
    CODES_KIND,
    PROMPT_KIND,
    REPLY_KIND,
    RNG_KIND,
    rows_to_wire,
    tensor_frame,
)
from omnimodel_runtime.protocol.stage import (
    FinalFrame,
    ResponseFrame,
    SamplingParams,
    StageInput,
    StageParams,
    StageRequest,
    TensorFrame,
)
from omnimodel_runtime.serve import serve_pipeline

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="module")]

MODEL = QWEN25
PROMPTS = BATCH_PROMPTS


def pcm(message: Mapping[str, Any]) -> np.ndarray:
    return wav_samples(base64.b64decode(message["audio"]["data"])).astype(np.int32)


def close_pcm(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.size > 0 and int(np.abs(a - b).max()) <= 1


def generated(metrics: str, stage: str) -> float:
    return metric_total(metrics, "omnimodel_generated_tokens_total", {"stage": stage})


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def serve(tiny_omni: Path, model_cache: Path) -> AsyncIterator[Served]:
    pipeline = serve_pipeline(
        MODEL, f"tiny://{MODEL}", device="cpu", engine_args={"batching": True, "max_batch_size": 4}
    )
    async with served_in_process(pipeline, model_cache, http_timeout=300) as served:
        yield served


def body(prompt: str, **extra: Any) -> dict[str, Any]:
    return chat_body(MODEL, prompt, **{"max_tokens": 24, **extra})


@pytest.mark.slow
async def test_the_stages_serve_batched(serve: Served) -> None:
    assert all(serve.engine(name).batched for name in ("thinker", "talker", "code2wav"))


@pytest.mark.slow
async def test_a_lone_greedy_request_gets_the_whole_models_text_and_waveform(
    serve: Served, whole_omni: Qwen25Whole
) -> None:
    resp = await serve.http.post("/v1/chat/completions", json={**body(""), "messages": USER})
    assert resp.status_code == 200, resp.text
    message = resp.json()["choices"][0]["message"]
    text, wav = whole_omni.generate(USER, speaker="Chelsie", max_tokens=24, seed=5)
    assert message["content"] == text
    assert close_pcm(pcm(message), wav_samples(wav).astype(np.int32))


@pytest.mark.slow
async def test_requests_sent_together_share_steps_and_each_gets_what_it_gets_alone(serve: Served) -> None:
    rounds = await alone_and_together(serve.http, [body(p) for p in PROMPTS])
    for single, message in zip(rounds.alone, rounds.together, strict=True):
        assert message["content"] == single["content"]
        assert close_pcm(pcm(message), pcm(single))
    assert rounds.shared_steps("thinker") and rounds.shared_steps("talker")


@pytest.mark.slow
async def test_streams_sent_together_get_their_audio_in_chunks(serve: Served) -> None:
    resps = await asyncio.gather(
        *(serve.http.post("/v1/chat/completions", json=body(p, stream=True, max_tokens=64)) for p in PROMPTS)
    )
    for resp in resps:
        assert resp.status_code == 200
        audio = streamed_audio(sse_chunks(resp.text))
        assert len(audio) >= 2
        samples = np.frombuffer(b"".join(audio), dtype="<i2")
        assert float(np.sqrt(np.mean((samples / 32767.0) ** 2))) > 0.01


@pytest.mark.slow
async def test_chunks_of_several_streams_in_one_dit_pass_match_one_pass_over_the_same_noise(serve: Served) -> None:
    import torch

    engine = serve.engine("code2wav")
    gen = torch.Generator().manual_seed(0)
    streams = [torch.randint(0, 64, (100,), generator=gen).numpy() for _ in range(3)]

    async def chunked(i: int, codes: np.ndarray) -> np.ndarray:
        pieces = await chunked_code2wav(engine, codes, seed=7 + i, request_id=f"chunked-{i}")
        assert len(pieces) >= 2
        return np.concatenate(pieces)

    before = (await serve.http.get("/metrics")).text
    results = await asyncio.gather(*(chunked(i, codes) for i, codes in enumerate(streams)))
    after = (await serve.http.get("/metrics")).text
    assert batched_steps(after, "code2wav") > batched_steps(before, "code2wav")
    for i, (codes, got) in enumerate(zip(streams, results, strict=True)):
        single = code2wav_one_pass(engine, codes, seed=7 + i)
        assert got.shape == single.shape
        assert float(np.abs(got - single).max()) < CHUNKED_TOLERANCE


@pytest.mark.slow
async def test_streams_sent_together_share_vocoder_passes_and_each_gets_its_audio_alone(
    serve: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a DiT pass over several streams' windows, BigVGAN voices their chunks as the rows of one batch
    (one pass and one copy to the host per mel length, not one per stream): each stream still gets, piece by
    piece, the audio it gets alone."""
    engine = serve.engine("code2wav")
    plan = engine._plan
    # One chunk size: which of several sizes a stream takes depends on how far ahead of real time it is, so
    # the same stream would be cut differently alone and together. And a length whose last full chunk does
    # not end at the look-ahead's edge, so that the end of the codes is known before the last window runs.
    monkeypatch.setattr(engine, "_plan", dataclasses.replace(plan, sizes=(plan.chunk,)))
    length = plan.first + 3 * plan.chunk + plan.lookahead + 1
    rng = np.random.default_rng(5)
    streams = [rng.integers(0, 64, length) for _ in range(3)]
    alone = [
        await chunked_code2wav(engine, codes, seed=7 + i, request_id=f"voiced-alone-{i}")
        for i, codes in enumerate(streams)
    ]
    vocoder = engine._vocoder
    passes: list[int] = []  # rows of each vocoder pass

    def counting(mel: torch.Tensor) -> torch.Tensor:
        passes.append(int(mel.shape[0]))
        return vocoder(mel)

    monkeypatch.setattr(engine, "_vocoder", counting)
    together = await asyncio.gather(
        *(
            chunked_code2wav(engine, codes, seed=7 + i, request_id=f"voiced-together-{i}")
            for i, codes in enumerate(streams)
        )
    )
    for single, pieces in zip(alone, together, strict=True):
        assert len(pieces) == len(single) == 5  # the first chunk, three more, the rest
        for a, b in zip(single, pieces, strict=True):
            assert a.shape == b.shape
            # The rounding of a matrix product over more rows, far below a 16-bit PCM step (3e-5).
            assert float(np.abs(a - b).max()) < 1e-5
    # Every piece is one row of a pass, and passes held several streams' pieces.
    assert sum(passes) == sum(len(pieces) for pieces in together)
    assert len(passes) < sum(passes), passes


@pytest.mark.slow
async def test_a_batched_step_s_frames_reach_the_event_loop_in_one_wake_up(serve: Served) -> None:
    """The talker's codes for every stream of a step leave in one flush (one event-loop wake-up), not one
    each: the loop thread competes for the GIL with the stage workers."""
    engine = serve.engine("talker")
    sizes: list[int] = []
    flush = engine.flush

    def counting() -> None:
        sizes.append(len(engine._outbox))
        flush()

    engine.flush = counting
    try:
        resps = await asyncio.gather(
            *(serve.http.post("/v1/chat/completions", json=body(p, stream=True, max_tokens=32)) for p in PROMPTS)
        )
    finally:
        del engine.flush
    assert all(resp.status_code == 200 for resp in resps)
    assert max(sizes) >= len(PROMPTS), sorted(sizes)[-10:]


@pytest.mark.slow
async def test_prefills_run_with_the_attention_kernels_the_stage_names(serve: Served) -> None:
    """``engine_args.prefill_attention`` holds inside the thinker's and the talker's ``generate()`` calls (on
    CUDA its default keeps cuDNN's attention, which builds a plan for every new length, off the first audio's
    path) and is let go after them."""
    seen: dict[str, list[tuple[bool, bool]]] = {"thinker": [], "talker": []}
    saved = {stage: serve.engine(stage).prefill_attention for stage in seen}
    hooks = []
    for stage, calls in seen.items():
        engine = serve.engine(stage)
        engine.prefill_attention = sdpa_backends("math")

        def record(*_: Any, calls: list[tuple[bool, bool]] = calls) -> None:
            calls.append((torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled()))

        hooks.append(engine.model.register_forward_pre_hook(record))
    try:
        resp = await serve.http.post("/v1/chat/completions", json=body(PROMPTS[2], max_tokens=8))
    finally:
        for hook in hooks:
            hook.remove()
        for stage, value in saved.items():
            serve.engine(stage).prefill_attention = value
    assert resp.status_code == 200, resp.text
    assert seen["thinker"] and seen["talker"]
    assert set(seen["thinker"]) == set(seen["talker"]) == {(False, True)}
    assert torch.backends.cuda.flash_sdp_enabled()


@pytest.mark.slow
async def test_a_prefill_does_not_build_a_default_config(serve: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """Handed no generation config, ``generate()`` builds a default instance of the model's config class on
    every call to look for legacy generation parameters: ~60 ms of the thinker's prefill on two CPU cores
    (its audio, vision and text sub-configs). The stages hand it the model's own."""
    built: list[str] = []
    for stage in ("thinker", "talker"):
        cls = type(serve.engine(stage).model.config)
        init = cls.__init__

        def counting(self: Any, *args: Any, _init: Any = init, _name: str = cls.__name__, **kwargs: Any) -> None:
            built.append(_name)
            _init(self, *args, **kwargs)

        monkeypatch.setattr(cls, "__init__", counting)
    resp = await serve.http.post("/v1/chat/completions", json=body(PROMPTS[3], max_tokens=8))
    assert resp.status_code == 200, resp.text
    assert built == []


@pytest.mark.slow
async def test_the_vocoder_gets_the_mel_lengths_it_captures_and_computes_what_bigvgan_does(serve: Served) -> None:
    """On CUDA the chunk vocoder replays graphs captured at start for the mel lengths a stream's chunks
    have (``ChunkPlan.vocoder_frames``); a length it did not foresee runs eagerly, correct but slow, so
    every chunk but a stream's last must have one of them. And its forward is BigVGAN's, bit for bit."""
    import torch

    engine = serve.engine("code2wav")
    vocoder = engine._vocoder
    lengths: list[int] = []

    def recording(mel: torch.Tensor) -> torch.Tensor:
        lengths.extend([int(mel.shape[2])] * int(mel.shape[0]))
        return vocoder.forward(mel)

    codes = torch.randint(0, 64, (300,), generator=torch.Generator().manual_seed(1)).numpy()
    engine._vocoder = recording
    try:
        await chunked_code2wav(engine, codes, seed=3, request_id="vocoder-lengths")
    finally:
        engine._vocoder = vocoder
    expected = engine._plan.vocoder_frames(int(engine.model.code2wav_dit_model.repeats))
    assert len(lengths) >= 3
    assert set(lengths[:-1]) <= expected, (lengths, expected)
    mel = torch.randn(
        (1, int(engine.model.code2wav_dit_model.mel_dim), lengths[0]), generator=torch.Generator().manual_seed(2)
    )
    with torch.inference_mode():
        assert torch.equal(vocoder.forward(mel), engine.model.code2wav_bigvgan_model(mel).reshape(1, -1))


@pytest.mark.slow
async def test_a_long_stream_s_dit_windows_all_have_captured_lengths(serve: Served) -> None:
    """Every DiT window of a stream, its last one too (widened to the left), has one of the lengths that
    run as graphs on CUDA (``ChunkPlan.windows``): an unforeseen length runs eagerly, several times slower."""
    engine = serve.engine("code2wav")
    mels = engine._mels
    lengths: list[int] = []
    run = mels.run

    def recording(items: list[Any]) -> Any:
        lengths.extend(int(window.codes.shape[0]) for _, window in items)
        return run(items)

    codes = np.random.default_rng(4).integers(0, 64, 301)
    mels.run = recording
    try:
        await chunked_code2wav(engine, codes, seed=3, request_id="window-lengths")
    finally:
        del mels.run
    assert len(lengths) >= 3
    assert set(lengths) <= engine._plan.windows(), lengths


def talker_input(engine: Any, replies: int) -> list[ResponseFrame]:
    """What the thinker sends the talker (made-up rows: a 3-row prompt and ``replies`` reply rows)."""
    size = int(engine.model.config.embedding_size)
    noise = torch.Generator().manual_seed(11)
    prompt, dtype = rows_to_wire(torch.randn((3, size), generator=noise).to(engine.model.dtype))
    reply, _ = rows_to_wire(torch.randn((replies, size), generator=noise).to(engine.model.dtype))
    head = {"prompt_rows": prompt, "prompt_ids": np.zeros(3, dtype=np.int64), "special_rows": prompt}
    return [
        tensor_frame(PROMPT_KIND, head, dtype=dtype, speaker_bos_token=0),
        tensor_frame(REPLY_KIND, {"rows": reply, "token_ids": np.zeros(replies, dtype=np.int64)}, dtype=dtype),
    ]


async def talk(engine: Any, frames: list[ResponseFrame], *, seed: int, cap: int) -> tuple[list[int], str, np.ndarray]:
    """The talker's codes, finish reason and the random-stream state it hands code2wav."""

    async def upstream() -> AsyncIterator[ResponseFrame]:
        for frame in frames:
            yield frame
        yield FinalFrame("stop")

    request = StageRequest(
        request_id=f"talk-{seed}-{cap}",
        prompt="",
        sampling=SamplingParams(seed=seed),
        params=StageParams(talker_max_new_tokens=cap),
    )
    codes: list[int] = []
    state, reason = None, ""
    async for frame in engine.generate(StageInput(request=request, upstream=upstream())):
        if isinstance(frame, TensorFrame) and frame.meta.get("kind") == CODES_KIND:
            codes.extend(int(c) for c in frame.tensors["codes"])
        elif isinstance(frame, TensorFrame) and frame.meta.get("kind") == RNG_KIND:
            state = np.asarray(frame.tensors["rng_state"])
        elif isinstance(frame, FinalFrame):
            reason = frame.finish_reason
    assert state is not None
    return codes, reason, state


@pytest.mark.slow
async def test_a_request_ending_on_its_eos_code_hands_code2wav_the_stream_as_its_last_draw_left_it(
    serve: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batched talker queues a request's next step before it reads the code that ends it (the host
    reads a step behind the GPU). That step's draw must not reach code2wav, whose noise continues the
    talker's random stream as in the whole model: the stream it gets is the seed's after exactly the draws
    of the codes spoken and the end code."""
    engine = serve.engine("talker")
    frames = talker_input(engine, replies=4)
    codes, reason, _ = await talk(engine, frames, seed=7, cap=8)
    assert (reason, len(codes)) == ("length", 8)
    end = next(i for i in range(2, 8) if codes[i] not in codes[:i])
    # That code now ends speech (same seed, same rows: the same codes up to it).
    monkeypatch.setitem(engine._generation, "eos_token_id", [codes[end]])
    spoken, reason, state = await talk(engine, frames, seed=7, cap=8)
    assert (reason, spoken) == ("stop", codes[:end])
    # end + 1 draws: the prefill's, one per decode step before the end code, the end code's. Each is
    # torch.multinomial's over one row of the codec vocabulary: one Exp(1) number per code.
    stream = torch.Generator().manual_seed(7)
    for _ in range(end + 1):
        torch.empty((1, int(engine.model.codec_head.out_features))).exponential_(1, generator=stream)
    assert np.array_equal(state, stream.get_state().numpy())


@pytest.mark.slow
async def test_a_client_going_away_frees_every_stage(serve: Served) -> None:
    """A real TCP client hangs up after the first text delta of a long answer: every stage drops the
    request (its slot, its chunks) long before the thousands of thinker steps it asked for."""
    engines = [serve.engine(name) for name in ("thinker", "talker", "code2wav")]
    long = body("Talk for a long time.", stream=True, max_tokens=4000, ignore_eos=True)
    before = generated((await serve.http.get("/metrics")).text, "thinker")
    loop = asyncio.get_running_loop()
    async with served_over_tcp(serve.app) as url:
        await hang_up_after_the_first_text(url, long)
        left = loop.time()
        assert any(engine.busy for engine in engines)
        while any(engine.busy for engine in engines):
            assert loop.time() < left + 5, "a stage kept working for a client that went away"
            await asyncio.sleep(0.05)
    thinker = serve.engine("thinker")
    assert thinker._slots is not None
    assert not thinker._slots.holders
    # Stopped, not finished: far fewer thinker tokens than the 4000 asked for.
    assert generated((await serve.http.get("/metrics")).text, "thinker") - before < 3000


@pytest.mark.slow
async def test_a_request_with_audio_and_an_image_runs_whole_through_generate_beside_the_batch(
    serve: Served, whole_omni: Qwen25Whole
) -> None:
    """The slot decoder does not carry the M-RoPE shift of media: such a request takes the one-at-a-time
    path inside the batched thinker, so its text is the whole model's exactly, while a text request sent
    with it still gets what it gets alone."""
    http = serve.http
    content = [audio_part(wav_file(1)), image_part(png_file()), {"type": "text", "text": "What is this?"}]
    media = {**body(""), "messages": [{"role": "user", "content": content}], "modalities": ["text"]}
    alone = await http.post("/v1/chat/completions", json=body("Count to ten.", modalities=["text"]))
    both = await asyncio.gather(
        http.post("/v1/chat/completions", json=media),
        http.post("/v1/chat/completions", json=body("Count to ten.", modalities=["text"])),
    )
    assert all(r.status_code == 200 for r in (alone, *both)), [r.text for r in both]
    text, _ = whole_omni.generate_content(content, speaker="Chelsie", max_tokens=24, seed=5, speech=False)
    assert both[0].json()["choices"][0]["message"]["content"] == text
    assert both[1].json()["choices"][0]["message"]["content"] == alone.json()["choices"][0]["message"]["content"]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def compiled(tiny_omni: Path, model_cache: Path) -> AsyncIterator[Served]:
    """The same stages with ``compile`` (the default on CUDA): the slot decoders' layers and code2wav's
    chunked DiT through ``torch.compile`` (on CUDA the compiled code is then captured as graphs)."""
    pipeline = serve_pipeline(
        MODEL, f"tiny://{MODEL}", device="cpu", engine_args={"batching": True, "max_batch_size": 4, "compile": True}
    )
    async with served_in_process(pipeline, model_cache, http_timeout=300) as served:
        yield served


# Inductor's CPU code generation imports a torch.jit helper that warns about itself (torch 2.13).
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
async def test_compiled_stages_give_the_whole_models_text_and_chunks_within_the_chunking_tolerance(
    compiled: Served, whole_omni: Qwen25Whole
) -> None:
    from torch._dynamo.utils import counters

    resp = await compiled.http.post("/v1/chat/completions", json={**body(""), "messages": USER})
    assert resp.status_code == 200, resp.text
    message = resp.json()["choices"][0]["message"]
    text, wav = whole_omni.generate(USER, speaker="Chelsie", max_tokens=24, seed=5)
    assert message["content"] == text
    assert close_pcm(pcm(message), wav_samples(wav).astype(np.int32))  # the whole path's DiT is the model's own
    # The slot decoders ran compiled (the engines' warm-up compiled them).
    assert all(compiled.engine(name)._slots.decoder.compiled for name in ("thinker", "talker"))

    graphs = counters["stats"]["unique_graphs"]
    engine = compiled.engine("code2wav")
    codes = np.arange(100) % 64
    pieces = await chunked_code2wav(engine, codes, seed=7, request_id="compiled-chunks")
    single = code2wav_one_pass(engine, codes, seed=7)
    got = np.concatenate(pieces)
    assert got.shape == single.shape
    assert float(np.abs(got - single).max()) < CHUNKED_TOLERANCE
    assert counters["stats"]["unique_graphs"] > graphs  # the chunks' DiT compiled (the whole path's is not)
