"""Audio and image input to Qwen3-Omni chat (``omnimodel serve``'s app, in process; over real TCP for the
streamed answer), on the tiny random-weight model, against the whole
``Qwen3OmniMoeForConditionalGeneration.generate()`` on the same media through the same processor.

The split stages' greedy answer equals the whole model's token for token, and their waveform byte for byte
(same seed): the talker reads the thinker's layer-``accept_hidden_layer`` hidden states at the audio/image
placeholders (``hidden_projection``) and the media's feature lengths and patch grids (its M-RoPE positions),
so both must arrive exactly.
"""

from __future__ import annotations

import base64
import io
import json
import wave
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import pytest_asyncio
from runtime_procs import served_over_tcp, wav_of
from test_omni_inputs import audio_part, image_part, png_file, wav_file
from test_qwen3_omni_pipeline import MODEL, STREAM_TOLERANCE_LSB, Whole

from omnimodel_runtime.serve import build_serve_app, serve_pipeline
from omnimodel_runtime.serving.audio import wav_bytes
from omnimodel_runtime.settings import RuntimeSettings

pytestmark = [
    pytest.mark.engine,
    pytest.mark.slow,
    pytest.mark.asyncio(loop_scope="module"),
    # The whole model's talker generate() warns that its repetition penalty skips the prompt (by design).
    pytest.mark.filterwarnings("ignore:Passing `repetition_penalty` with `inputs_embeds`:UserWarning"),
]

QUESTION = "What do you hear?"


def whole_generate(
    whole: Whole, content: Sequence[dict[str, Any]], *, speaker: str, max_tokens: int, seed: int
) -> tuple[str, np.ndarray]:
    """The whole model's reply text and float waveform for one user message of OpenAI ``content`` parts,
    its media decoded as a client library would (libsndfile, Pillow) and fed through the checkpoint's
    processor (``Qwen3OmniMoeProcessor``) in Hugging Face's own chat format."""
    import soundfile
    import torch
    from PIL import Image
    from transformers import Qwen3OmniMoeProcessor

    from omnimodel_runtime.engines.omni.inputs import load_processor

    processor = load_processor(whole.model_dir, Qwen3OmniMoeProcessor)
    parts: list[dict[str, Any]] = []
    audio: list[np.ndarray] = []
    images: list[Any] = []
    for part in content:
        if part["type"] == "input_audio":
            samples, rate = soundfile.read(io.BytesIO(base64.b64decode(part["input_audio"]["data"])), dtype="float32")
            assert rate == processor.feature_extractor.sampling_rate
            audio.append(samples)
            parts.append({"type": "audio", "audio": samples})
        elif part["type"] == "image_url":
            data = base64.b64decode(part["image_url"]["url"].split(",", 1)[1])
            images.append(Image.open(io.BytesIO(data)).convert("RGB"))
            parts.append({"type": "image", "image": images[-1]})
        else:
            parts.append(part)
    text = processor.apply_chat_template(
        [{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False
    )
    inputs = processor(text=[text], audio=audio or None, images=images or None, return_tensors="pt")
    generation = json.loads((whole.model_dir / "omni_generation_config.json").read_text())["talker"]
    torch.manual_seed(seed)
    sequences, waveform = whole.model.generate(
        **inputs,
        speaker=speaker,
        thinker_max_new_tokens=max_tokens,
        thinker_do_sample=False,
        thinker_eos_token_id=whole.model.config.im_end_token_id,
        talker_max_new_tokens=generation["max_new_tokens"],
    )
    reply = whole.tokenizer.decode(sequences[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    return reply, waveform.reshape(-1).numpy()


@pytest.fixture(scope="module")
def tiny(model_cache: Path) -> Path:
    from omnimodel_runtime.tiny import ensure_tiny

    return ensure_tiny(MODEL, model_cache)


@pytest.fixture(scope="module")
def whole(tiny: Path) -> Whole:
    return Whole(tiny)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def serve(tiny: Path, model_cache: Path) -> AsyncIterator[httpx.AsyncClient]:
    """``omnimodel serve --preset qwen3-omni --model tiny://qwen3-omni``: every stage in this process."""
    settings = RuntimeSettings(model_cache=model_cache, device="cpu")
    app = build_serve_app(settings, serve_pipeline(MODEL, f"tiny://{MODEL}", device="cpu"))
    async with app.router.lifespan_context(app):
        await app.state.startup.wait()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=120) as http:
            yield http


def client(http: httpx.AsyncClient) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="unused", http_client=http, max_retries=0)


async def spoken(serve: httpx.AsyncClient, content: list[dict[str, Any]], *, voice: str, seed: int) -> Any:
    """The split stages' answer (text and WAV) to one user message, with the official client."""
    return await client(serve).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],  # type: ignore[list-item]
        modalities=["text", "audio"],
        audio={"voice": voice, "format": "wav"},  # type: ignore[typeddict-item]
        max_tokens=16,
        temperature=0,
        seed=seed,
    )


async def test_voice_chat_answers_the_audio_as_the_whole_model_does(serve: httpx.AsyncClient, whole: Whole) -> None:
    """A WAV in, text and audio out: the whole model's text and waveform."""
    content = [audio_part(wav_file(1.5)), {"type": "text", "text": QUESTION}]
    message = (await spoken(serve, content, voice="Chelsie", seed=5)).choices[0].message
    assert message.audio is not None
    text, waveform = whole_generate(whole, content, speaker="Chelsie", max_tokens=16, seed=5)
    assert (message.content, message.audio.transcript) == (text, text)
    assert wav_of(message.model_dump()) == wav_bytes(waveform, 24000)
    # Without the audio the answer is another one: the thinker listened.
    no_audio = await client(serve).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=16, temperature=0
    )
    assert no_audio.choices[0].message.content != text


async def test_image_chat_answers_as_the_whole_model_does(serve: httpx.AsyncClient, whole: Whole) -> None:
    """An image_url data URL in, text and audio out: the whole model's text and waveform (the vision
    encoder's deepstack features join the thinker after its first layer)."""
    content = [{"type": "text", "text": "Describe it."}, image_part(png_file(64, 96))]
    reply = await spoken(serve, content, voice="Ethan", seed=9)
    message = reply.choices[0].message
    assert message.audio is not None
    text, waveform = whole_generate(whole, content, speaker="Ethan", max_tokens=16, seed=9)
    assert message.content == text
    assert wav_of(message.model_dump()) == wav_bytes(waveform, 24000)
    # 64 x 96 pixels: 4 x 6 patches of 16, merged 2 x 2 into 6 image tokens, between 2 markers.
    text_only = await client(serve).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe it."}], max_tokens=1
    )
    assert reply.usage is not None
    assert text_only.usage is not None
    assert reply.usage.prompt_tokens - text_only.usage.prompt_tokens == 6 + 2


@pytest.mark.parametrize("layer", [0, 2])
async def test_the_talker_reads_the_thinker_at_any_accept_hidden_layer(
    serve: httpx.AsyncClient, whole: Whole, monkeypatch: pytest.MonkeyPatch, layer: int
) -> None:
    """The tiny checkpoint's accept_hidden_layer (1 of 2) is a decoder layer's own output (a middle one, as
    in transformers' default config); the ends are other tensors (0: the input embeddings; 2: the
    final-normed output). Each, set on the thinker stage and on the whole model alike, still gives the whole
    model's waveform, and another one than layer 1's: the talker does hear those rows."""
    content = [audio_part(wav_file(1.0, seed=7)), {"type": "text", "text": QUESTION}]
    at_layer_1 = wav_of((await spoken(serve, content, voice="Ethan", seed=2)).choices[0].message.model_dump())
    app = serve._transport.app  # type: ignore[attr-defined]
    monkeypatch.setattr(app.state.orchestrator.handles["thinker"].engine, "_accept_layer", layer)
    monkeypatch.setattr(whole.model.config.talker_config, "accept_hidden_layer", layer)
    message = (await spoken(serve, content, voice="Ethan", seed=2)).choices[0].message
    _, waveform = whole_generate(whole, content, speaker="Ethan", max_tokens=16, seed=2)
    assert wav_of(message.model_dump()) == wav_bytes(waveform, 24000) != at_layer_1


async def test_streamed_voice_chat_over_tcp_with_the_openai_client(serve: httpx.AsyncClient, whole: Whole) -> None:
    """A WAV in, streamed text and audio out: the whole model's text, its waveform within the streamed
    vocoder's tolerance (test_qwen3_omni_pipeline.py)."""
    content = [audio_part(wav_file(1.0)), {"type": "text", "text": QUESTION}]
    app = serve._transport.app  # type: ignore[attr-defined]
    async with (
        served_over_tcp(app) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as tcp,
    ):
        stream = await tcp.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": content}],  # type: ignore[list-item]
            modalities=["text", "audio"],
            max_tokens=16,
            temperature=0,
            seed=5,
            stream=True,
        )
        text, pcm = "", b""
        async for chunk in stream:
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta.model_dump()
            text += delta.get("content") or ""
            pcm += base64.b64decode((delta.get("audio") or {}).get("data") or "")
    whole_text, waveform = whole_generate(whole, content, speaker="Ethan", max_tokens=16, seed=5)
    assert text == whole_text
    samples = np.frombuffer(pcm, dtype="<i2")
    reference = np.frombuffer(wav_bytes(waveform, 24000)[44:], dtype="<i2")
    assert samples.size == reference.size
    assert int(np.abs(samples.astype(np.int32) - reference).max()) <= STREAM_TOLERANCE_LSB


async def prompt_tokens(serve: httpx.AsyncClient, wav: bytes) -> int:
    body = {"model": MODEL, "messages": [{"role": "user", "content": [audio_part(wav)]}], "max_tokens": 1}
    resp = await serve.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    return int(resp.json()["usage"]["prompt_tokens"])


async def test_prompt_tokens_grow_with_the_audio_at_any_sample_rate(serve: httpx.AsyncClient) -> None:
    """13 audio tokens a second: the audio encoder takes 100 mel frames (1 s at 16 kHz) per chunk and
    downsamples each 8x, to 13; a file at another rate is resampled to the feature extractor's 16 kHz."""
    one, two, three = [await prompt_tokens(serve, wav_file(s)) for s in (1, 2, 3)]
    assert (two - one, three - two) == (13, 13)
    assert await prompt_tokens(serve, wav_file(2, rate=24000)) == two


@pytest.mark.parametrize(
    ("part", "what"),
    [
        ({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}, "video_url"),
        (audio_part(b"this is not a wav file"), "cannot decode the audio"),
        (
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"no").decode()}},
            "cannot decode the image",
        ),
    ],
)
async def test_a_part_it_cannot_take_is_a_400_naming_the_part(
    serve: httpx.AsyncClient, part: dict[str, Any], what: str
) -> None:
    content = [{"type": "text", "text": QUESTION}, part]
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "modalities": ["text", "audio"]}
    resp = await serve.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "messages[0].content[1]"
    assert what in resp.json()["error"]["message"]


# What vLLM-Omni's examples/online_serving/qwen3_omni/openai_chat_completion_client_for_multimodal_generation.py
# sends for `--query-type use_audio` (its system prompt as a content list, the audio as vLLM's `audio_url`
# data URL, per-stage sampling in extra_body, modalities left out).
VLLM_OMNI_SYSTEM = {
    "role": "system",
    "content": [
        {
            "type": "text",
            "text": "You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of perceiving "
            "auditory and visual inputs, as well as generating text and speech.",
        }
    ],
}
VLLM_OMNI_SAMPLING = [
    {"temperature": 0.4, "top_p": 0.9, "top_k": 1, "max_tokens": 16384, "repetition_penalty": 1.05,
     "stop_token_ids": [151645], "seed": 42},
    {"temperature": 0.9, "top_k": 50, "max_tokens": 4096, "seed": 42, "detokenize": False,
     "repetition_penalty": 1.05, "stop_token_ids": [2150]},
    {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_tokens": 65536, "seed": 42, "detokenize": True,
     "repetition_penalty": 1.1},
]  # fmt: skip


async def test_vllm_omnis_qwen3_omni_client_gets_text_and_audio_for_its_audio_url(
    tiny: Path, model_cache: Path, serve: httpx.AsyncClient
) -> None:
    """Its body unchanged, on a server set up as docs/vllm-omni-compat.md says for its clients (chat
    answers text and audio when ``modalities`` is left out): the answer has text and a WAV, and the thinker
    read the audio exactly as an ``input_audio`` part of the same file (the same prompt tokens, more than
    without it)."""
    wav = wav_file(2)
    audio_url = {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64," + base64.b64encode(wav).decode()}}
    question = {"type": "text", "text": "What is the content of this audio?"}
    settings = RuntimeSettings(model_cache=model_cache, device="cpu", chat_default_modalities=["text", "audio"])
    app = build_serve_app(settings, serve_pipeline(MODEL, f"tiny://{MODEL}", device="cpu"))
    async with app.router.lifespan_context(app):
        await app.state.startup.wait()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=120) as http:
            reply = await client(http).chat.completions.create(
                messages=[VLLM_OMNI_SYSTEM, {"role": "user", "content": [audio_url, question]}],  # type: ignore[list-item]
                model=MODEL,
                modalities=None,
                max_tokens=8,  # the client asks for none (16384 in its per-stage list): the tiny model rambles
                extra_body={"sampling_params_list": VLLM_OMNI_SAMPLING},
            )
    (choice,) = reply.choices
    assert choice.message.content
    assert choice.message.audio is not None
    with wave.open(io.BytesIO(base64.b64decode(choice.message.audio.data))) as w:
        assert (w.getnchannels(), w.getframerate()) == (1, 24000)
        assert w.getnframes() > 0

    async def tokens(content: list[dict[str, Any]]) -> int:
        body = {"model": MODEL, "messages": [VLLM_OMNI_SYSTEM, {"role": "user", "content": content}], "max_tokens": 1}
        resp = await serve.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        return int(resp.json()["usage"]["prompt_tokens"])

    assert reply.usage is not None
    assert reply.usage.prompt_tokens == await tokens([audio_part(wav), question]) > await tokens([question])
