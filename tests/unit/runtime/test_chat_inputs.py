"""Content parts of chat messages through the API, on every preset that serves chat, with fake stage
engines: what each model takes (text everywhere; audio, images and video on the omni thinkers), a 400
naming the part for anything else, and the media reaching the entry stage as request tensors (in process
and in the request frame of the stage protocol). The real thinkers on these inputs: tests/component."""

from __future__ import annotations

import asyncio
import base64
from contextlib import AsyncExitStack
from typing import Any, Final

import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.responses import Response
from runtime_fakes import FakeServe, asgi_client, lifespan, serve_on_loopback

from omnimodel_runtime.pipeline import ModelSource, get_preset
from omnimodel_runtime.pipeline.presets import PRESETS
from omnimodel_runtime.protocol.frames import decode_frames, encode_frame_bytes
from omnimodel_runtime.protocol.stage import MediaInput, RequestFrame, StageRequest
from omnimodel_runtime.settings import RuntimeSettings

CHAT_PRESETS = sorted(
    name for name, preset in PRESETS.items() if "chat" in preset.pipeline(ModelSource(source=f"tiny://{name}")).routes
)
WAV = b"RIFF....WAVEfmt fake bytes: the gateway does not decode them"
PNG = b"\x89PNG\r\n\x1a\nfake"
MP4 = b"\x00\x00\x00\x18ftypmp42 fake"
# The presets whose thinker takes audio and images.
OMNI: Final = ["qwen2.5-omni", "qwen3-omni"]


def audio_part(data: bytes = WAV, fmt: str = "wav") -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


def audio_url_part(url: str | None = None) -> dict[str, Any]:
    """vLLM's ``audio_url`` part (what vLLM-Omni's Qwen-Omni clients send for audio)."""
    return {"type": "audio_url", "audio_url": {"url": url or "data:audio/wav;base64," + base64.b64encode(WAV).decode()}}


def image_part(url: str | None = None) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url or "data:image/png;base64," + base64.b64encode(PNG).decode()}}


def video_part(url: str | None = None, **extra: Any) -> dict[str, Any]:
    url = url or "data:video/mp4;base64," + base64.b64encode(MP4).decode()
    return {"type": "video_url", "video_url": {"url": url, **extra}}


def text_part(text: str = "What is this?") -> dict[str, Any]:
    return {"type": "text", "text": text}


def serve(preset: str, settings: RuntimeSettings | None = None) -> FakeServe:
    return FakeServe(get_preset(preset).pipeline(ModelSource(source=f"tiny://{preset}")), settings=settings)


async def post(fake: FakeServe, messages: list[dict[str, Any]], **extra: Any) -> Any:
    async with lifespan(fake.app), asgi_client(fake.app) as http:
        body = {"messages": messages, "max_tokens": 2, **extra}
        return await http.post("/v1/chat/completions", json=body)


def test_every_preset_that_serves_chat_is_covered() -> None:
    assert CHAT_PRESETS == ["qwen-image-edit", "qwen2.5-omni", "qwen3-omni", "text", "text-to-image"]


_PARTS: list[tuple[str, dict[str, Any], set[str]]] = [
    ("input_audio", audio_part(), set(OMNI)),
    ("audio_url", audio_url_part(), set(OMNI)),
    # The image to edit, on the edit preset (test_image_edit_chat.py).
    ("image_url", image_part(), {*OMNI, "qwen-image-edit"}),
    ("video_url", video_part(), {"qwen2.5-omni", "qwen3-omni"}),
    ("input_video", {"type": "input_video", "video": "AAAA"}, set()),
    ("file", {"type": "file", "file": {"file_id": "f"}}, set()),
    ("refusal", {"type": "refusal", "refusal": "no"}, set()),
]
# Every (preset, part) whose model cannot take the part: the ones it takes are tested for what they do.
_REFUSED = [(preset, name, part) for name, part, takes in _PARTS for preset in CHAT_PRESETS if preset not in takes]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("preset", "name", "part"), _REFUSED, ids=[f"{p}-{n}" for p, n, _ in _REFUSED])
async def test_a_part_the_model_cannot_take_is_a_400_naming_it(
    preset: str, name: str, part: dict[str, Any], stream: bool
) -> None:
    fake = serve(preset)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [text_part(), part]}]
    resp = await post(fake, messages, stream=stream)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "messages[1].content[1]"
    assert error["type"] == "invalid_request_error"
    assert part["type"] in error["message"]
    assert all(not e.requests for e in fake.engines.values())  # refused before any stage


@pytest.mark.parametrize("preset", ["text", "qwen2.5-omni"])
async def test_text_parts_are_taken_everywhere(preset: str) -> None:
    fake = serve(preset)
    resp = await post(fake, [{"role": "user", "content": [text_part("one"), text_part("two")]}])
    assert resp.status_code == 200, resp.text
    (inp,) = fake.engine.requests
    assert inp.request.messages == ({"role": "user", "content": [text_part("one"), text_part("two")]},)
    assert inp.request.media == ()
    assert inp.tensors == {}


@pytest.mark.parametrize("preset", OMNI)
async def test_the_omni_thinker_gets_audio_and_images_as_placeholders_and_request_tensors(preset: str) -> None:
    fake = serve(preset)
    messages = [{"role": "user", "content": [audio_part(), text_part(), image_part(), audio_part(b"second", "flac")]}]
    resp = await post(fake, messages)
    assert resp.status_code == 200, resp.text
    (inp,) = fake.engine.requests
    content = [{"type": "audio"}, text_part(), {"type": "image"}, {"type": "audio"}]
    assert inp.request.messages == ({"role": "user", "content": content},)
    assert inp.request.media == (
        MediaInput(kind="audio", tensor="media.0", format="wav", param="messages[0].content[0]"),
        MediaInput(kind="image", tensor="media.1", format="image/png", param="messages[0].content[2]"),
        MediaInput(kind="audio", tensor="media.2", format="flac", param="messages[0].content[3]"),
    )
    assert {k: v.tobytes() for k, v in inp.tensors.items()} == {"media.0": WAV, "media.1": PNG, "media.2": b"second"}
    assert all(v.dtype == np.uint8 for v in inp.tensors.values())


@pytest.mark.parametrize("preset", OMNI)
async def test_an_audio_url_part_is_the_same_audio_input_as_input_audio(preset: str) -> None:
    """vLLM's ``audio_url`` with a data URL: the same placeholder and bytes as ``input_audio``; the
    format is the data URL's type (the thinker's decoder reads the container from the bytes)."""
    fake = serve(preset)
    flac = "data:audio/flac;base64," + base64.b64encode(b"second").decode()
    messages = [{"role": "user", "content": [audio_url_part(), text_part(), audio_url_part(flac)]}]
    resp = await post(fake, messages)
    assert resp.status_code == 200, resp.text
    (inp,) = fake.engine.requests
    assert inp.request.messages == ({"role": "user", "content": [{"type": "audio"}, text_part(), {"type": "audio"}]},)
    assert inp.request.media == (
        MediaInput(kind="audio", tensor="media.0", format="audio/wav", param="messages[0].content[0]"),
        MediaInput(kind="audio", tensor="media.1", format="audio/flac", param="messages[0].content[2]"),
    )
    assert {k: v.tobytes() for k, v in inp.tensors.items()} == {"media.0": WAV, "media.1": b"second"}


async def test_a_video_part_is_a_video_placeholder_with_its_frames_and_audio_wish() -> None:
    """vLLM-Omni's shape: ``video_url`` with an optional ``num_frames``, and ``mm_processor_kwargs.
    use_audio_in_video`` for the whole request (each video's MediaInput carries it to the thinker)."""
    fake = serve("qwen2.5-omni")
    messages = [{"role": "user", "content": [video_part(num_frames=8), text_part(), audio_part()]}]
    resp = await post(fake, messages, mm_processor_kwargs={"use_audio_in_video": True})
    assert resp.status_code == 200, resp.text
    (inp,) = fake.engine.requests
    assert inp.request.messages == ({"role": "user", "content": [{"type": "video"}, text_part(), {"type": "audio"}]},)
    assert inp.request.media == (
        MediaInput(
            kind="video",
            tensor="media.0",
            format="video/mp4",
            param="messages[0].content[0]",
            num_frames=8,
            use_audio=True,
        ),
        MediaInput(kind="audio", tensor="media.1", format="wav", param="messages[0].content[2]"),
    )
    assert inp.tensors["media.0"].tobytes() == MP4
    # Without the flag the video comes alone; another processor argument is refused, not ignored.
    await post(fake, [{"role": "user", "content": [video_part()]}])
    assert fake.engine.requests[-1].request.media[0].use_audio is False
    resp = await post(fake, [{"role": "user", "content": [video_part()]}], mm_processor_kwargs={"fps": 4})
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "mm_processor_kwargs.fps"


@pytest.mark.parametrize("preset", OMNI)
async def test_voice_chat_sends_the_media_to_the_entry_stage_only(preset: str) -> None:
    fake = serve(preset)
    # The fake talker and code2wav answer text, not audio: what matters here is what they were sent.
    await post(fake, [{"role": "user", "content": [audio_part()]}], modalities=["text", "audio"])
    (thinker,) = fake.engines["thinker"].requests
    assert thinker.tensors["media.0"].tobytes() == WAV
    for stage in ("talker", "code2wav"):
        for inp in fake.engines[stage].requests:
            assert inp.tensors == {}


def test_media_travel_in_the_request_frame() -> None:
    request = StageRequest(
        request_id="r",
        messages=({"role": "user", "content": [{"type": "audio"}]},),
        media=(MediaInput(kind="audio", tensor="media.0", format="wav", param="messages[0].content[0]"),),
    )
    sent = RequestFrame(request=request, tensors={"media.0": np.frombuffer(WAV, dtype=np.uint8)})
    (got,) = decode_frames(encode_frame_bytes(sent))
    assert isinstance(got, RequestFrame)
    assert got.request == request
    assert got.tensors["media.0"].tobytes() == WAV


@pytest.mark.parametrize(
    ("part", "message"),
    [
        ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "input_audio.data"),
        ({"type": "input_audio", "input_audio": "UklGRg=="}, "input_audio: Input should be"),
        ({"type": "image_url", "image_url": "data:image/png;base64,AAAA"}, "image_url: Input should be"),
        ({"type": "input_audio", "input_audio": {"data": "not base64!", "format": "wav"}}, "not valid base64"),
        ({"type": "input_audio"}, "needs input_audio.data"),
        (image_part("data:text/plain;base64,aGVsbG8="), "not an image"),
        (image_part("data:image/png,rawbytes"), "base64 data URLs"),
        (image_part("ftp://example.com/cat.png"), "data: URL or an http(s) URL"),
        (image_part("https://example.com/cat.png"), "does not fetch remote images"),
        ({"type": "image_url"}, "needs image_url.url"),
        (video_part("data:image/png;base64,AAAA"), "not a video"),
        (video_part("https://example.com/cat.mp4"), "does not fetch remote videos"),
        (video_part(num_frames=0), "video_url.num_frames"),
        ({"type": "video_url"}, "needs video_url.url"),
        (audio_url_part("data:image/png;base64,AAAA"), "not an audio file"),
        (audio_url_part("https://example.com/a.wav"), "does not fetch remote audio files"),
        ({"type": "audio_url"}, "needs audio_url.url"),
        ({"type": "audio_url", "audio_url": "data:audio/wav;base64,AAAA"}, "audio_url: Input should be"),
    ],
    ids=[
        *("empty", "not-object", "url-not-object", "bad-base64", "no-payload"),
        *("not-image", "not-base64", "scheme", "remote", "no-url"),
        *("not-video", "remote-video", "no-frames", "no-video-url"),
        *("not-audio", "remote-audio", "no-audio-url", "audio-url-not-object"),
    ],
)
async def test_a_broken_media_part_is_a_400_naming_it(part: dict[str, Any], message: str) -> None:
    fake = serve("qwen2.5-omni")
    resp = await post(fake, [{"role": "user", "content": [text_part(), part]}])
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert message in error["message"]
    assert error["param"].startswith("messages[0].content[1]")
    assert not fake.engine.requests


async def test_the_audio_format_must_be_one_the_thinker_decodes() -> None:
    resp = await post(serve("qwen2.5-omni"), [{"role": "user", "content": [audio_part(fmt="ogg")]}])
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "messages[0].content[0].input_audio.format"


async def test_media_outside_a_user_message_is_refused() -> None:
    resp = await post(serve("qwen2.5-omni"), [{"role": "assistant", "content": [audio_part()]}])
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "messages[0].content[0]"
    assert "user messages only" in resp.json()["error"]["message"]


async def test_remote_images_are_fetched_when_allowed() -> None:
    """``OMNIMODEL_MEDIA_FETCH=true``: an http(s) ``image_url`` is fetched (a real server on loopback),
    within ``OMNIMODEL_MEDIA_MAX_BYTES``; a failed fetch is a 400 naming the part."""
    images = FastAPI()
    images.state.startup = asyncio.Event()
    images.state.startup.set()
    seen: list[str] = []

    @images.get("/{name}")
    async def image(name: str) -> Response:
        seen.append(name)
        if name == "big.png":
            return Response(b"x" * 2048, media_type="image/png")
        if name == "missing.png":
            return Response(status_code=404)
        return Response(PNG, media_type="image/png")

    fake = serve("qwen2.5-omni", RuntimeSettings(media_fetch=True, media_max_bytes=1024))
    async with AsyncExitStack() as stack:
        url = await serve_on_loopback(images, stack)
        resp = await post(fake, [{"role": "user", "content": [image_part(f"{url}/cat.png")]}])
        assert resp.status_code == 200, resp.text
        assert seen == ["cat.png"]
        assert fake.engine.requests[0].tensors["media.0"].tobytes() == PNG
        for name, message in (("big.png", "larger than 1024 bytes"), ("missing.png", "HTTP 404")):
            resp = await post(fake, [{"role": "user", "content": [text_part(), image_part(f"{url}/{name}")]}])
            assert resp.status_code == 400
            assert message in resp.json()["error"]["message"]
            assert resp.json()["error"]["param"] == "messages[0].content[1]"
