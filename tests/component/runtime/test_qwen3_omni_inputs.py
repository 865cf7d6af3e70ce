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
from pathlib import Path
from typing import Any

import pytest
from omni_helpers import (
    QWEN3,
    QWEN3_MARKS,
    Qwen3Whole,
    assert_qwen3_stream_matches,
    audio_part,
    image_part,
    png_file,
    spoken_chat,
    video_part,
    wav_file,
)
from runtime_procs import Served, serve_fixture, served_in_process, streamed_chat_over_tcp, wav_of

from omnimodel_runtime.serve import serve_pipeline

pytestmark = QWEN3_MARKS

MODEL = QWEN3
QUESTION = "What do you hear?"


serve = serve_fixture(MODEL, "tiny_qwen3")


async def spoken(serve: Served, content: list[dict[str, Any]], *, voice: str, seed: int) -> Any:
    """The split stages' answer (text and WAV) to one user message, with the official client."""
    messages = [{"role": "user", "content": content}]
    return await serve.openai.chat.completions.create(
        **spoken_chat(messages, voice=voice, max_tokens=16, seed=seed, model=MODEL)
    )


@pytest.mark.slow
async def test_voice_chat_answers_the_audio_as_the_whole_model_does(serve: Served, whole_qwen3: Qwen3Whole) -> None:
    """A WAV in, text and audio out: the whole model's text and waveform."""
    content = [audio_part(wav_file(1.5)), {"type": "text", "text": QUESTION}]
    message = (await spoken(serve, content, voice="Chelsie", seed=5)).choices[0].message
    assert message.audio is not None
    text, wav = whole_qwen3.generate_content(content, speaker="Chelsie", max_tokens=16, seed=5)
    assert (message.content, message.audio.transcript) == (text, text)
    assert wav_of(message.model_dump()) == wav
    # Without the audio the answer is another one: the thinker listened.
    no_audio = await serve.openai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=16, temperature=0
    )
    assert no_audio.choices[0].message.content != text


@pytest.mark.slow
async def test_image_chat_answers_as_the_whole_model_does(serve: Served, whole_qwen3: Qwen3Whole) -> None:
    """An image_url data URL in, text and audio out: the whole model's text and waveform (the vision
    encoder's deepstack features join the thinker after its first layer)."""
    content = [{"type": "text", "text": "Describe it."}, image_part(png_file(64, 96))]
    reply = await spoken(serve, content, voice="Ethan", seed=9)
    message = reply.choices[0].message
    assert message.audio is not None
    text, wav = whole_qwen3.generate_content(content, speaker="Ethan", max_tokens=16, seed=9)
    assert message.content == text
    assert wav_of(message.model_dump()) == wav
    # 64 x 96 pixels: 4 x 6 patches of 16, merged 2 x 2 into 6 image tokens, between 2 markers.
    text_only = await serve.openai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe it."}], max_tokens=1
    )
    assert reply.usage is not None
    assert text_only.usage is not None
    assert reply.usage.prompt_tokens - text_only.usage.prompt_tokens == 6 + 2


@pytest.mark.slow
@pytest.mark.parametrize("layer", [0, 2])
async def test_the_talker_reads_the_thinker_at_any_accept_hidden_layer(
    serve: Served, whole_qwen3: Qwen3Whole, monkeypatch: pytest.MonkeyPatch, layer: int
) -> None:
    """The tiny checkpoint's accept_hidden_layer (1 of 2) is a decoder layer's own output (a middle one, as
    in transformers' default config); the ends are other tensors (0: the input embeddings; 2: the
    final-normed output). Each, set on the thinker stage and on the whole model alike, still gives the whole
    model's waveform, and another one than layer 1's: the talker does hear those rows."""
    content = [audio_part(wav_file(1.0, seed=7)), {"type": "text", "text": QUESTION}]
    at_layer_1 = wav_of((await spoken(serve, content, voice="Ethan", seed=2)).choices[0].message.model_dump())
    monkeypatch.setattr(serve.engine("thinker"), "_accept_layer", layer)
    monkeypatch.setattr(whole_qwen3.model.config.talker_config, "accept_hidden_layer", layer)
    message = (await spoken(serve, content, voice="Ethan", seed=2)).choices[0].message
    _, wav = whole_qwen3.generate_content(content, speaker="Ethan", max_tokens=16, seed=2)
    assert wav_of(message.model_dump()) == wav != at_layer_1


@pytest.mark.slow
async def test_streamed_voice_chat_over_tcp_with_the_openai_client(serve: Served, whole_qwen3: Qwen3Whole) -> None:
    """A WAV in, streamed text and audio out: the whole model's text, its waveform within the streamed
    vocoder's tolerance (``QWEN3_STREAM_TOLERANCE_LSB``, as in test_qwen3_omni_pipeline.py)."""
    content = [audio_part(wav_file(1.0)), {"type": "text", "text": QUESTION}]
    messages = [{"role": "user", "content": content}]
    chunks = await streamed_chat_over_tcp(
        serve.app, model=MODEL, messages=messages, modalities=["text", "audio"], max_tokens=16, temperature=0, seed=5
    )
    whole_text, wav = whole_qwen3.generate_content(content, speaker="Ethan", max_tokens=16, seed=5)
    assert_qwen3_stream_matches(chunks, whole_text, wav)


async def prompt_tokens(serve: Served, wav: bytes) -> int:
    body = {"model": MODEL, "messages": [{"role": "user", "content": [audio_part(wav)]}], "max_tokens": 1}
    resp = await serve.http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    return int(resp.json()["usage"]["prompt_tokens"])


@pytest.mark.slow
async def test_prompt_tokens_grow_with_the_audio_at_any_sample_rate(serve: Served) -> None:
    """13 audio tokens a second: the audio encoder takes 100 mel frames (1 s at 16 kHz) per chunk and
    downsamples each 8x, to 13; a file at another rate is resampled to the feature extractor's 16 kHz."""
    one, two, three = [await prompt_tokens(serve, wav_file(s)) for s in (1, 2, 3)]
    assert (two - one, three - two) == (13, 13)
    assert await prompt_tokens(serve, wav_file(2, rate=24000)) == two


@pytest.mark.slow
@pytest.mark.parametrize(
    ("part", "what"),
    [
        (video_part(b"\0\0\0"), "cannot decode the video"),
        (audio_part(b"this is not a wav file"), "cannot decode the audio"),
        (image_part(b"no"), "cannot decode the image"),
    ],
)
async def test_a_part_it_cannot_take_is_a_400_naming_the_part(serve: Served, part: dict[str, Any], what: str) -> None:
    content = [{"type": "text", "text": QUESTION}, part]
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "modalities": ["text", "audio"]}
    resp = await serve.http.post("/v1/chat/completions", json=body)
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


@pytest.mark.slow
async def test_vllm_omnis_qwen3_omni_client_gets_text_and_audio_for_its_audio_url(
    model_cache: Path, serve: Served
) -> None:
    """Its body unchanged (plus its seed, as the request's), on a server set up as docs/vllm-omni-compat.md
    says for its clients (chat answers text and audio when ``modalities`` is left out): the answer has text
    and a WAV, and the thinker read the audio exactly as an ``input_audio`` part of the same file (the same
    prompt tokens, more than without it)."""
    wav = wav_file(2)
    audio_url = {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64," + base64.b64encode(wav).decode()}}
    question = {"type": "text", "text": "What is the content of this audio?"}
    pipeline = serve_pipeline(MODEL, f"tiny://{MODEL}", device="cpu")
    async with served_in_process(pipeline, model_cache, chat_default_modalities=["text", "audio"]) as served:
        reply = await served.openai.chat.completions.create(
            messages=[VLLM_OMNI_SYSTEM, {"role": "user", "content": [audio_url, question]}],  # type: ignore[list-item]
            model=MODEL,
            modalities=None,
            max_tokens=8,  # the client asks for none (16384 in its per-stage list): the tiny model rambles
            # The per-stage list is ignored (docs/vllm-omni-compat.md), so its seed 42 is given as the
            # request's own: without one, the talker draws from a fresh seed, and the tiny random talker
            # can draw its end-of-codes token first now and then (an empty WAV, and a flaky test).
            seed=42,
            extra_body={"sampling_params_list": VLLM_OMNI_SAMPLING},
        )
    (choice,) = reply.choices
    assert choice.message.content
    assert choice.message.audio is not None
    wav_of(choice.message.model_dump())  # a WAV file: mono, 24 kHz, not empty

    async def tokens(content: list[dict[str, Any]]) -> int:
        body = {"model": MODEL, "messages": [VLLM_OMNI_SYSTEM, {"role": "user", "content": content}], "max_tokens": 1}
        resp = await serve.http.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        return int(resp.json()["usage"]["prompt_tokens"])

    assert reply.usage is not None
    assert reply.usage.prompt_tokens == await tokens([audio_part(wav), question]) > await tokens([question])
