"""Chat content parts → what the entry stage gets: messages with placeholders, media refs, media bytes.

Which parts a model takes is its entry stage's (``Pipeline.input_modalities``): ``text`` everywhere,
``input_audio`` (or vLLM's ``audio_url``, a data URL of the file) and ``image_url`` where the entry stage
takes audio and images (the Qwen2.5-Omni and Qwen3-Omni thinkers), and ``video_url`` (vLLM's part) where
it takes video (the same two thinkers).
Every other part, and a media part the model cannot take, is a 400 naming the part
(``messages[0].content[1]``): never dropped in silence.

Media are checked and base64-decoded here (a broken data URL is a 400 before any stage is asked) but not
decoded further: the bytes of the file travel to the entry stage as a uint8 tensor of the request
(:class:`~omnimodel_runtime.protocol.stage.MediaInput`), where the engine decodes, resamples and encodes
them with the model's own processor. An ``audio_url``, ``image_url`` or ``video_url`` that is not a data URL is fetched
only when ``OMNIMODEL_MEDIA_FETCH`` allows it (off by default: a gateway fetching any URL a client names is a
server-side request forgery waiting to happen).
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, TypeVar

import httpx
import numpy as np
from pydantic import BaseModel, ValidationError

from omnimodel_runtime.pipeline import InputModality
from omnimodel_runtime.protocol.openai import (
    AUDIO_URL_PART,
    IMAGE_URL_PART,
    INPUT_AUDIO_PART,
    TEXT_PART,
    VIDEO_URL_PART,
    AudioURLParam,
    ChatMessageParam,
    ContentPart,
    ImageURLParam,
    InputAudio,
    VideoURLParam,
)
from omnimodel_runtime.protocol.stage import MediaInput
from omnimodel_runtime.serving.errors import APIError

# The placeholder part a media part becomes in the stage request's messages (Hugging Face's chat
# template vocabulary, which the Qwen2.5-Omni template renders as its audio, image and video placeholders).
PLACEHOLDER: Final[Mapping[InputModality, Literal["audio", "image", "video"]]] = {
    InputModality.AUDIO: "audio",
    InputModality.IMAGE: "image",
    InputModality.VIDEO: "video",
}
_PART_MODALITY: Final = {
    INPUT_AUDIO_PART: InputModality.AUDIO,
    AUDIO_URL_PART: InputModality.AUDIO,
    IMAGE_URL_PART: InputModality.IMAGE,
    VIDEO_URL_PART: InputModality.VIDEO,
}
_DATA_URL: Final = re.compile(
    r"data:(?P<mime>[\w.+-]+/[\w.+-]+)(?P<params>(?:;[^;,]*)*?);base64,(?P<data>.*)", re.DOTALL
)
FETCH_TIMEOUT_S: Final = 10.0
_PLURAL: Final = {"image": "images", "video": "videos", "audio": "audio files"}


@dataclass(frozen=True)
class MediaPolicy:
    """What the gateway does with media URLs: fetch http(s) ones (``fetch``), up to ``max_bytes`` each."""

    fetch: bool = False
    max_bytes: int = 20 * 1024 * 1024


# Data URLs only (the settings' default).
NO_FETCH: Final = MediaPolicy()


@dataclass
class ChatContent:
    """The messages of a chat as its entry stage gets them, the media in order, and their bytes."""

    messages: tuple[dict[str, Any], ...]
    media: tuple[MediaInput, ...] = ()
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    # Remote media still to fetch: (tensor name, URL, param, what it is).
    remote: list[tuple[str, str, str, str]] = field(default_factory=list)

    async def fetch(self, policy: MediaPolicy) -> None:
        """Fetch the remote media (only ever present when ``policy.fetch``)."""
        if not self.remote:
            return
        async with httpx.AsyncClient(timeout=FETCH_TIMEOUT_S, follow_redirects=False) as client:
            for name, url, param, noun in self.remote:
                self.tensors[name] = _as_tensor(await _download(client, url, param, policy.max_bytes, noun))
        self.remote.clear()


def part_param(message: int, part: int) -> str:
    """The name of one content part in errors (OpenAI's own spelling)."""
    return f"messages[{message}].content[{part}]"


def _accepted(accepts: Collection[InputModality]) -> str:
    return ", ".join(m.value for m in accepts)


def chat_content(
    messages: Sequence[ChatMessageParam],
    *,
    accepts: Collection[InputModality],
    model: str,
    policy: MediaPolicy,
    use_audio_in_video: bool = False,
) -> ChatContent:
    """Check every content part against what the model takes (``accepts``) and split the media out
    (``use_audio_in_video``: each video's audio track is input too).

    Raises a 400 naming the part for an unknown part type, a media part the model cannot take, a media
    part outside a user message, a part missing its payload, bad base64 or an unfetchable URL.
    """
    out: list[dict[str, Any]] = []
    media: list[MediaInput] = []
    tensors: dict[str, np.ndarray] = {}
    remote: list[tuple[str, str, str, str]] = []
    for i, message in enumerate(messages):
        entry: dict[str, Any] = {"role": message.role}
        if isinstance(message.content, list):
            parts: list[dict[str, Any]] = []
            for j, part in enumerate(message.content):
                param = part_param(i, j)
                if part.type == TEXT_PART:
                    parts.append(part.model_dump(exclude_none=True, include={"type", "text"}))
                    continue
                modality = _PART_MODALITY.get(part.type)
                if modality is None:
                    known = ", ".join([TEXT_PART, *(t for t, m in _PART_MODALITY.items() if m in accepts)])
                    raise APIError(
                        f"{param}: content part type {part.type!r} is not supported (model {model!r} takes {known})",
                        param=param,
                    )
                if modality not in accepts:
                    raise APIError(
                        f"{param}: model {model!r} does not take {modality.value} input ({part.type} parts); "
                        f"it takes {_accepted(accepts)}",
                        param=param,
                    )
                if message.role != "user":
                    raise APIError(f"{param}: {part.type} parts are accepted in user messages only", param=param)
                name = f"media.{len(media)}"
                fmt, data, url = _payload(part, param, policy)
                kind = PLACEHOLDER[modality]
                if url is not None:
                    remote.append((name, url, param, kind))
                else:
                    assert data is not None
                    tensors[name] = _as_tensor(data)
                video = modality is InputModality.VIDEO
                media.append(
                    MediaInput(
                        kind=kind,
                        tensor=name,
                        format=fmt,
                        param=param,
                        num_frames=_video_url(part, param).num_frames if video else None,
                        use_audio=video and use_audio_in_video,
                    )
                )
                parts.append({"type": kind})
            entry["content"] = parts
        else:
            entry["content"] = message.content or ""
        if message.name is not None:
            entry["name"] = message.name
        out.append(entry)
    return ChatContent(messages=tuple(out), media=tuple(media), tensors=tensors, remote=remote)


def check_text_only(messages: Sequence[ChatMessageParam], *, model: str) -> None:
    """A 400 naming the first content part that is not text (for chat on pipelines that read text only
    and build no stage messages, such as text to image)."""
    chat_content(messages, accepts=(InputModality.TEXT,), model=model, policy=NO_FETCH)


def _video_url(part: ContentPart, param: str) -> VideoURLParam:
    if part.video_url is None:
        raise APIError(f"{param}: a video_url part needs video_url.url", param=param)
    return _validated(VideoURLParam, part.video_url, f"{param}.video_url")


def _payload(part: ContentPart, param: str, policy: MediaPolicy) -> tuple[str, bytes | None, str | None]:
    """``(format, bytes, None)`` for inline media, ``(format, None, url)`` for a file to fetch."""
    if part.type == INPUT_AUDIO_PART:
        if part.input_audio is None:
            raise APIError(f"{param}: an input_audio part needs input_audio.data and input_audio.format", param=param)
        audio = _validated(InputAudio, part.input_audio, f"{param}.input_audio")
        return audio.format, _b64(audio.data, param), None
    if part.type == VIDEO_URL_PART:
        noun, url, example = "video", _video_url(part, param).url, "data:video/mp4;base64,..."
    elif part.type == AUDIO_URL_PART:
        if part.audio_url is None:
            raise APIError(f"{param}: an audio_url part needs audio_url.url", param=param)
        noun, url = "audio", _validated(AudioURLParam, part.audio_url, f"{param}.audio_url").url
        example = "data:audio/wav;base64,..."
    else:
        if part.image_url is None:
            raise APIError(f"{param}: an image_url part needs image_url.url", param=param)
        noun, url = "image", _validated(ImageURLParam, part.image_url, f"{param}.image_url").url
        example = "data:image/png;base64,..."
    match = _DATA_URL.fullmatch(url)
    if match is not None:
        mime = match["mime"].lower()
        if not mime.startswith(f"{noun}/"):
            what = {"image": "an image", "video": "a video", "audio": "an audio file"}[noun]
            raise APIError(f"{param}: the data URL holds {mime!r}, not {what}", param=param)
        return mime, _b64(match["data"], param), None
    if url.startswith("data:"):
        raise APIError(f"{param}: only base64 data URLs are accepted ({example})", param=param)
    if not url.startswith(("http://", "https://")):
        raise APIError(f"{param}: {part.type}.url must be a data: URL or an http(s) URL", param=param)
    if not policy.fetch:
        raise APIError(
            f"{param}: this server does not fetch remote {_PLURAL[noun]} (send the {noun} as a data: URL; "
            "an operator can allow fetching with OMNIMODEL_MEDIA_FETCH=true)",
            param=param,
        )
    return "", None, url


_M = TypeVar("_M", bound=BaseModel)


def _validated(model: type[_M], value: Any, where: str) -> _M:
    """``value`` as ``model``, or a 400 naming the field that is wrong (``messages[0].content[1]...``)."""
    try:
        return model.model_validate(value)
    except ValidationError as err:
        first = err.errors()[0]
        field = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"])
        raise APIError(f"{where}{field}: {first['msg']}", param=f"{where}{field}") from None


def _b64(text: str, param: str) -> bytes:
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(f"{param}: the data is not valid base64", param=param) from None
    if not data:
        raise APIError(f"{param}: the data is empty", param=param)
    return data


def _as_tensor(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8)


async def _download(client: httpx.AsyncClient, url: str, param: str, max_bytes: int, noun: str) -> bytes:
    try:
        async with client.stream("GET", url) as resp:
            if resp.status_code != 200:
                raise APIError(f"{param}: fetching the {noun} answered HTTP {resp.status_code}", param=param)
            chunks: list[bytes] = []
            size = 0
            async for chunk in resp.aiter_bytes():
                size += len(chunk)
                if size > max_bytes:
                    raise APIError(f"{param}: the {noun} is larger than {max_bytes} bytes", param=param)
                chunks.append(chunk)
    except httpx.HTTPError as err:
        raise APIError(f"{param}: cannot fetch the {noun}: {err}", param=param) from err
    if not size:
        raise APIError(f"{param}: the {noun} is empty", param=param)
    return b"".join(chunks)
