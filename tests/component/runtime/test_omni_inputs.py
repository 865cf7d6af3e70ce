"""Audio and image input to Qwen2.5-Omni chat (in process, ``serve``-shaped), on the tiny random-weight
model, against the whole model's own ``generate()`` on the same media through the same processor.

The split pipeline's greedy answer equals the whole model's token for token, and its waveform (the
talker's M-RoPE positions depend on the audio's feature length and the image's patch grid) byte for byte.
Through stage processes: test_omni_processes.py.
"""

from __future__ import annotations

import base64
import io
import json
import warnings
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import pytest_asyncio
from test_omni_pipeline import MODEL, Whole, wav_of

from omnimodel_runtime.serve import build_serve_app, serve_pipeline
from omnimodel_runtime.serving.audio import wav_bytes
from omnimodel_runtime.settings import RuntimeSettings

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

QUESTION = "What do you hear?"


def wav_file(seconds: float, rate: int = 16000, seed: int = 3) -> bytes:
    """A WAV file (16-bit PCM) of noise at ``rate``."""
    import soundfile

    samples = (np.random.default_rng(seed).standard_normal(int(seconds * rate)) * 0.1).astype(np.float32)
    out = io.BytesIO()
    soundfile.write(out, samples, rate, format="WAV", subtype="PCM_16")
    return out.getvalue()


def png_file(height: int = 56, width: int = 84, seed: int = 4) -> bytes:
    from PIL import Image

    pixels = (np.random.default_rng(seed).random((height, width, 3)) * 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def audio_part(data: bytes, fmt: str = "wav") -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


def image_part(data: bytes) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}


@dataclass(frozen=True)
class VideoInput:
    """A video as the whole model gets it: its frames (all of them, as sampled), their rate, and its audio
    track (16 kHz mono) to interleave with them (``use_audio_in_video``) or None."""

    frames: np.ndarray
    fps: float
    audio: np.ndarray | None = None


def whole_generate(
    whole: Whole,
    content: Sequence[dict[str, Any]],
    *,
    speaker: str,
    max_tokens: int,
    seed: int,
    threads: int | None = None,
    speech: bool = True,
    video: VideoInput | None = None,
) -> tuple[str, bytes | None]:
    """The whole model's text and WAV (``speech=False``: text only, no WAV) for one user message of OpenAI
    ``content`` parts, its media decoded as a client library would (libsndfile, Pillow; the frames of a
    ``video_url`` part are ``video``'s) and fed through the checkpoint's processor in Hugging Face's own
    chat format."""
    import soundfile
    import torch
    from PIL import Image

    from omnimodel_runtime.engines.omni.inputs import audio_in_video_kwargs, load_processor

    if threads is not None:
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return whole_generate(
                whole, content, speaker=speaker, max_tokens=max_tokens, seed=seed, speech=speech, video=video
            )
        finally:
            torch.set_num_threads(previous)
    processor = load_processor(whole.model_dir)
    parts: list[dict[str, Any]] = []
    audio: list[np.ndarray] = []
    sources: list[int | None] = []  # per audio input: None, or 0 for the video's track
    images: list[Any] = []
    for part in content:
        if part["type"] == "input_audio":
            samples, rate = soundfile.read(io.BytesIO(base64.b64decode(part["input_audio"]["data"])), dtype="float32")
            assert rate == processor.feature_extractor.sampling_rate
            audio.append(samples)
            sources.append(None)
            parts.append({"type": "audio", "audio": samples})
        elif part["type"] == "image_url":
            data = base64.b64decode(part["image_url"]["url"].split(",", 1)[1])
            images.append(Image.open(io.BytesIO(data)).convert("RGB"))
            parts.append({"type": "image", "image": images[-1]})
        elif part["type"] == "video_url":
            assert video is not None
            if video.audio is not None:
                audio.append(video.audio)  # in the video's place: the processor reads them in text order
                sources.append(0)
            parts.append({"type": "video", "video": "frames"})
        else:
            parts.append(part)
    text = processor.apply_chat_template(
        [{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False
    )
    with_audio = video is not None and video.audio is not None
    videos: dict[str, Any] = {}
    if video is not None:
        videos = {"videos": [video.frames], "fps": video.fps, "cap_pixels_per_frame": True}
        if with_audio:
            # The argument's name and form depend on the transformers release.
            videos.update(audio_in_video_kwargs(processor, sources))
    with warnings.catch_warnings():
        # transformers 5.19 interleaves a video's audio with np.arange(a torch scalar), which numpy 2
        # reports as deprecated; the stage under test runs the same line.
        warnings.filterwarnings("ignore", "__array__ implementation", DeprecationWarning)
        inputs = processor(
            text=[text],
            audio=audio or None,
            images=images or None,
            return_tensors="pt",
            **videos,
        )
    talker = whole.model.talker
    generation = json.loads((whole.model_dir / "omni_generation_config.json").read_text())["talker"]
    torch.manual_seed(seed)
    if not speech:
        sequences = whole.model.generate(
            **inputs,
            use_audio_in_video=with_audio,
            thinker_max_new_tokens=max_tokens,
            thinker_do_sample=False,
            generation_mode="text",
        )
        return whole.tokenizer.decode(sequences[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True), None
    # transformers 5.19's whole generate() hands the image's and video's pixels to the talker too, whose
    # generate() refuses them ("model_kwargs are not used"): the talker reads only their grids.
    talker_generate = talker.generate

    def without_pixels(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop("pixel_values", None)
        kwargs.pop("pixel_values_videos", None)
        return talker_generate(*args, **kwargs)

    talker.generate = without_pixels
    try:
        sequences, waveform = whole.model.generate(
            **inputs,
            use_audio_in_video=with_audio,
            speaker=speaker,
            thinker_max_new_tokens=max_tokens,
            thinker_do_sample=False,
            talker_max_new_tokens=generation["max_new_tokens"],
            talker_eos_token_id=[talker.codec_pad_token, talker.codec_eos_token],
        )
    finally:
        del talker.generate
    reply = whole.tokenizer.decode(sequences[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    return reply, wav_bytes(waveform.numpy(), 24000)


@pytest.fixture(scope="module")
def tiny_omni(model_cache: Path) -> Path:
    from omnimodel_runtime.tiny import ensure_tiny

    return ensure_tiny(MODEL, model_cache)


@pytest.fixture(scope="module")
def whole(tiny_omni: Path) -> Whole:
    return Whole(tiny_omni)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def http(tiny_omni: Path, model_cache: Path) -> AsyncIterator[httpx.AsyncClient]:
    settings = RuntimeSettings(model_cache=model_cache, device="cpu")
    app = build_serve_app(settings, serve_pipeline(MODEL, f"tiny://{MODEL}", device="cpu"))
    async with app.router.lifespan_context(app):
        await app.state.startup.wait()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=120) as client:
            yield client


def client(http: httpx.AsyncClient) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="unused", http_client=http, max_retries=0)


async def test_voice_chat_answers_the_audio_as_the_whole_model_does(http: httpx.AsyncClient, whole: Whole) -> None:
    """Audio in, text and audio out, with the official client: the whole model's text and waveform."""
    content = [audio_part(wav_file(1.5)), {"type": "text", "text": QUESTION}]
    reply = await client(http).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],  # type: ignore[list-item]
        modalities=["text", "audio"],
        audio={"voice": "Chelsie", "format": "wav"},
        max_tokens=16,
        temperature=0,
        seed=5,
    )
    message = reply.choices[0].message
    assert message.audio is not None
    text, wav = whole_generate(whole, content, speaker="Chelsie", max_tokens=16, seed=5)
    assert (message.content, message.audio.transcript) == (text, text)
    assert wav_of(message.model_dump()) == wav
    # Without the audio the answer is another one: the thinker listened.
    no_audio = await client(http).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=16,
        temperature=0,
    )
    assert no_audio.choices[0].message.content != text


async def test_image_chat_answers_as_the_whole_model_does(http: httpx.AsyncClient, whole: Whole) -> None:
    """Image in, text and audio out: the whole model's text and waveform (the talker's M-RoPE positions
    follow the image's patch grid, which the thinker's prompt frame carries)."""
    content = [{"type": "text", "text": "Describe it."}, image_part(png_file())]
    messages: Any = [{"role": "user", "content": content}]
    reply = await client(http).chat.completions.create(
        model=MODEL,
        messages=messages,
        modalities=["text", "audio"],
        audio={"voice": "Ethan", "format": "wav"},
        max_tokens=12,
        temperature=0,
        seed=9,
    )
    message = reply.choices[0].message
    assert message.audio is not None
    text, wav = whole_generate(whole, content, speaker="Ethan", max_tokens=12, seed=9)
    assert message.content == text
    assert wav_of(message.model_dump()) == wav
    text_only_reply, _ = whole_generate(whole, content, speaker="Ethan", max_tokens=12, seed=9, speech=False)
    assert text_only_reply == text
    # 56 x 84 pixels: 4 x 6 patches of 14, merged 2 x 2 into 6 image tokens (the markers are in both).
    text_only = await client(http).chat.completions.create(
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


async def test_prompt_tokens_grow_with_the_audio_at_any_sample_rate(http: httpx.AsyncClient) -> None:
    """25 audio tokens a second (Whisper's 100 mel frames a second, pooled 4x), whatever the file's rate:
    it is resampled to the feature extractor's 16 kHz; mp3 and flac files too."""
    import soundfile

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


async def test_streamed_voice_chat_answers_audio_with_text_and_audio_chunks(http: httpx.AsyncClient) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": [audio_part(wav_file(1)), {"type": "text", "text": QUESTION}]}],
        "modalities": ["text", "audio"],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 24,
        "temperature": 0,
    }
    resp = await http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    pcm = b"".join(
        base64.b64decode(c["choices"][0]["delta"]["audio"]["data"])
        for c in chunks
        if c["choices"] and (c["choices"][0]["delta"].get("audio") or {}).get("data")
    )
    assert text
    assert len(pcm) > 0
    usage = next(c["usage"] for c in chunks if c.get("usage"))
    assert usage["prompt_tokens"] > 25  # the second of audio is in the prompt


@pytest.mark.parametrize("stream", [False, True])
async def test_a_file_that_does_not_decode_is_a_400_naming_its_part(http: httpx.AsyncClient, stream: bool) -> None:
    for part, what in (
        (audio_part(b"this is not a wav file"), "cannot decode the audio"),
        (
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"nope").decode()}},
            "cannot decode the image",
        ),
    ):
        content = [{"type": "text", "text": QUESTION}, part]
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "stream": stream}
        resp = await http.post("/v1/chat/completions", json={**body, "modalities": ["text", "audio"]})
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == "messages[0].content[1]"
        assert what in resp.json()["error"]["message"]
