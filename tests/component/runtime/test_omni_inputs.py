"""Audio and image input to Qwen2.5-Omni chat (in process, ``serve``-shaped), on the tiny random-weight
model, against the whole model's own ``generate()`` on the same media through the same processor.

The split pipeline's greedy answer equals the whole model's token for token, and its waveform (the
talker's M-RoPE positions depend on the audio's feature length and the image's patch grid) byte for byte.
Through stage processes: test_omni_processes.py.
"""

from __future__ import annotations

import io

import httpx
import numpy as np
import pytest
from omni_helpers import QWEN25, Qwen25Whole, audio_part, image_part, png_file, spoken_chat, wav_file
from runtime_procs import Served, serve_fixture, sse_chunks, streamed_audio, streamed_text, wav_of

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="module")]

MODEL = QWEN25
QUESTION = "What do you hear?"


serve = serve_fixture(MODEL, "tiny_omni")


@pytest.mark.slow
async def test_voice_chat_answers_the_audio_as_the_whole_model_does(serve: Served, whole_omni: Qwen25Whole) -> None:
    """Audio in, text and audio out, with the official client: the whole model's text and waveform."""
    content = [audio_part(wav_file(1.5)), {"type": "text", "text": QUESTION}]
    messages = [{"role": "user", "content": content}]
    reply = await serve.openai.chat.completions.create(**spoken_chat(messages, voice="Chelsie", max_tokens=16, seed=5))
    message = reply.choices[0].message
    assert message.audio is not None
    text, wav = whole_omni.generate_content(content, speaker="Chelsie", max_tokens=16, seed=5)
    assert (message.content, message.audio.transcript) == (text, text)
    assert wav_of(message.model_dump()) == wav
    # Without the audio the answer is another one: the thinker listened.
    no_audio = await serve.openai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=16,
        temperature=0,
    )
    assert no_audio.choices[0].message.content != text


@pytest.mark.slow
async def test_image_chat_answers_as_the_whole_model_does(serve: Served, whole_omni: Qwen25Whole) -> None:
    """Image in, text and audio out: the whole model's text and waveform (the talker's M-RoPE positions
    follow the image's patch grid, which the thinker's prompt frame carries)."""
    content = [{"type": "text", "text": "Describe it."}, image_part(png_file())]
    messages = [{"role": "user", "content": content}]
    reply = await serve.openai.chat.completions.create(**spoken_chat(messages, voice="Ethan", max_tokens=12, seed=9))
    message = reply.choices[0].message
    assert message.audio is not None
    text, wav = whole_omni.generate_content(content, speaker="Ethan", max_tokens=12, seed=9)
    assert message.content == text
    assert wav_of(message.model_dump()) == wav
    text_only_reply, _ = whole_omni.generate_content(content, speaker="Ethan", max_tokens=12, seed=9, speech=False)
    assert text_only_reply == text
    # 56 x 84 pixels: 4 x 6 patches of 14, merged 2 x 2 into 6 image tokens (the markers are in both).
    text_only = await serve.openai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe it."}], max_tokens=1
    )
    assert reply.usage is not None
    assert text_only.usage is not None
    assert reply.usage.prompt_tokens - text_only.usage.prompt_tokens == 6 + 2


async def prompt_tokens(http: httpx.AsyncClient, wav: bytes, fmt: str = "wav") -> int:
    body = {"model": MODEL, "messages": [{"role": "user", "content": [audio_part(wav, fmt)]}], "max_tokens": 1}
    resp = await http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    return int(resp.json()["usage"]["prompt_tokens"])


@pytest.mark.slow
async def test_prompt_tokens_grow_with_the_audio_at_any_sample_rate(serve: Served) -> None:
    """25 audio tokens a second (Whisper's 100 mel frames a second, pooled 4x), whatever the file's rate:
    it is resampled to the feature extractor's 16 kHz; mp3 and flac files too."""
    import soundfile

    http = serve.http
    one, two = await prompt_tokens(http, wav_file(1)), await prompt_tokens(http, wav_file(2))
    assert two - one == 25
    assert await prompt_tokens(http, wav_file(2, rate=24000)) == two
    assert await prompt_tokens(http, wav_file(2, rate=8000)) == two
    samples = np.random.default_rng(0).standard_normal(32000).astype(np.float32) * 0.1
    for fmt in ("flac", "mp3"):
        out = io.BytesIO()
        soundfile.write(out, samples, 16000, format=fmt.upper())
        # An mp3 encoder pads the start and end of the stream: a few frames more.
        assert abs(await prompt_tokens(http, out.getvalue(), fmt) - two) <= (0 if fmt == "flac" else 2)


@pytest.mark.slow
async def test_streamed_voice_chat_answers_audio_with_text_and_audio_chunks(serve: Served) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": [audio_part(wav_file(1)), {"type": "text", "text": QUESTION}]}],
        "modalities": ["text", "audio"],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 24,
        "temperature": 0,
    }
    resp = await serve.http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    chunks = sse_chunks(resp.text)
    text = streamed_text(chunks)
    pcm = b"".join(streamed_audio(chunks))
    assert text
    assert len(pcm) > 0
    usage = next(c["usage"] for c in chunks if c.get("usage"))
    assert usage["prompt_tokens"] > 25  # the second of audio is in the prompt


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
async def test_a_file_that_does_not_decode_is_a_400_naming_its_part(serve: Served, stream: bool) -> None:
    for part, what in (
        (audio_part(b"this is not a wav file"), "cannot decode the audio"),
        (image_part(b"nope"), "cannot decode the image"),
    ):
        content = [{"type": "text", "text": QUESTION}, part]
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "stream": stream}
        resp = await serve.http.post("/v1/chat/completions", json={**body, "modalities": ["text", "audio"]})
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == "messages[0].content[1]"
        assert what in resp.json()["error"]["message"]
