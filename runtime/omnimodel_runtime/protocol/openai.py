"""OpenAI wire models (the subset OmniModel serves), shaped after vLLM's ``entrypoints/openai`` protocol.

Requests ignore unknown fields (clients send vendor extras freely) but validate every field we act on,
so a bad value is a 400 naming the field, never a 500 further down. Responses carry exactly the fields
the official ``openai`` client reads.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Final, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

# OpenAI's own limit on stop sequences.
MAX_STOP_SEQUENCES = 4
# OpenAI's own limit on the messages of a chat request ("array too long ... maximum length 2048"): checked
# while the body is validated, so 100 000 messages are refused before any work scales with them (a chat
# template over each, then a tokenizer: 3 s on the tiny text model before this bound, 0.07 s with it).
MAX_MESSAGES: Final = 2048
# The most characters of text one prompt may hold (all its messages' text, or a completion prompt), for the
# same reason: the tiny text model took 7.6 s to tokenize 3.9 MB of words only to find them longer than its
# context. 1 Mi characters is some 250 000 tokens of English, beyond every preset's context.
MAX_PROMPT_CHARS: Final = 1024 * 1024
_INT64 = 2**63
# Token ids are indices into an embedding table: never negative, and no vocabulary has 2^31 entries. The
# engine checks them against its own vocabulary (a 400 naming ``prompt``); this bound keeps ids that do
# not even fit an int32 (``10**23``) from reaching a tensor constructor.
MAX_TOKEN_ID: Final = 2**31 - 1

# A seed every engine accepts: torch generators take the int64 range (and vLLM its own int64 seed).
Seed = Annotated[int, Field(ge=-_INT64, lt=_INT64)]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]


def unicode_text(value: str) -> str:
    """``value`` unless it holds a lone UTF-16 surrogate, which is a pydantic error naming where.

    JSON may escape one (``"a\\ud800b"``) and Python's JSON parser keeps it, but it is no Unicode character:
    no UTF-8 encoding carries it, so a tokenizer raises on it (a TypeError deep in a batch), a stage request
    cannot be serialised and an answer echoing it cannot be encoded. The message does not quote the value
    for the same reason.
    """
    if value.isascii():
        return value
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise PydanticCustomError(
            "string_unicode",
            "holds a lone UTF-16 surrogate ({code} at character {index}), which is not Unicode text",
            {"code": f"U+{ord(value[err.start]):04X}", "index": err.start},
        ) from None
    return value


# Free text that reaches a tokenizer (or is forwarded to a stage): valid Unicode, checked here.
Text = Annotated[str, AfterValidator(unicode_text)]


def random_id(prefix: str) -> str:
    """A response id in OpenAI's style (``chatcmpl-…``, ``cmpl-…``)."""
    return f"{prefix}-{uuid.uuid4().hex}"


def _now() -> int:
    return int(time.time())


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class OpenAIRequestModel(OpenAIBaseModel):
    """What a client sends. Strict: a value of the wrong JSON type is a 400, as the schema says
    (``"seed": false`` or ``"max_tokens": "5"`` are not quietly turned into 0 and 5); integers still
    pass as numbers."""

    model_config = ConfigDict(extra="ignore", strict=True)


EXTRA_BODY: Final = "extra_body"


def merge_extra_body(data: Any) -> Any:
    """A body whose nested ``"extra_body"`` object is merged into its root.

    The ``openai`` client merges ``extra_body=`` into the JSON root itself, but vLLM-Omni's own example
    clients and diffusion benchmark (plain ``requests``/``aiohttp``/curl) send it as a key of the body, which
    vLLM-Omni merges on the server. A field given both at the root and in ``extra_body`` is refused (as
    vLLM-Omni does): neither place silently wins. Anything but an object is left for the field to refuse.
    Errors found here have no location in the body; their context names the field (``param``).
    """
    if not isinstance(data, dict) or not isinstance(data.get(EXTRA_BODY), dict):
        return data
    root = {k: v for k, v in data.items() if k != EXTRA_BODY}
    nested: dict[str, Any] = data[EXTRA_BODY]
    for key in nested:
        if key == EXTRA_BODY:
            raise PydanticCustomError(
                "extra_body", "extra_body must not contain another extra_body", {"param": "extra_body.extra_body"}
            )
        if key in root:
            raise PydanticCustomError(
                "extra_body",
                "{key} is given both at the top level and in extra_body; send it once",
                {"key": key, "param": f"extra_body.{key}"},
            )
    return root | nested


class OpenAIRequestBody(OpenAIRequestModel):
    """The whole body of a request (not a part of one): accepts vLLM-Omni's nested ``extra_body``."""

    extra_body: dict[str, Any] | None = Field(
        default=None,
        description="Extension fields nested as vLLM-Omni's clients send them; merged into the body "
        "(a field both here and at the top level is a 400).",
    )

    @model_validator(mode="before")
    @classmethod
    def _merge_extra_body(cls, data: Any) -> Any:
        return merge_extra_body(data)


# ---------------------------------------------------------------- errors


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(OpenAIBaseModel):
    """The envelope every error response uses: ``{"error": {message, type, param, code}}``."""

    error: ErrorInfo


# ---------------------------------------------------------------- shared


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class StreamOptions(OpenAIRequestModel):
    include_usage: bool = False


StopParam = str | list[str] | None


def _check_stop(value: StopParam) -> StopParam:
    stops = [value] if isinstance(value, str) else (value or [])
    for stop in stops:
        unicode_text(stop)
    if len(stops) > MAX_STOP_SEQUENCES:
        raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
    if any(s == "" for s in stops):
        raise ValueError("stop sequences must not be empty")
    return value


def stop_list(value: StopParam) -> tuple[str, ...]:
    """The stop parameter as a tuple of strings."""
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


class _SamplingFields(OpenAIRequestBody):
    """Sampling parameters both APIs share (plus vLLM's ``ignore_eos`` extension)."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    n: Annotated[int, Field(ge=1)] = 1
    seed: Seed | None = None
    stop: StopParam = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extension: keep generating past end-of-sequence until max_tokens (benchmarks, tests).
    ignore_eos: bool = False
    # OpenAI parameters the engines do not implement. Declared so that a request using them is refused
    # with a 400 naming the field (serving.text) instead of being answered as if they had been applied;
    # their neutral values (0, {}, null) are accepted.
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None

    _validate_stop = field_validator("stop")(_check_stop)


# ---------------------------------------------------------------- chat


# The media content parts a user message may carry (serving.media says which a model takes).
INPUT_AUDIO_PART: Final = "input_audio"
IMAGE_URL_PART: Final = "image_url"
# Not OpenAI's: vLLM's and vLLM-Omni's (their Qwen2.5-Omni and Qwen3-Omni clients send them).
VIDEO_URL_PART: Final = "video_url"
AUDIO_URL_PART: Final = "audio_url"
TEXT_PART: Final = "text"


class InputAudio(OpenAIRequestModel):
    """``input_audio`` of an ``input_audio`` part: a whole audio file, base64 (OpenAI's formats plus flac)."""

    data: Annotated[str, Field(min_length=1)]
    format: Literal["wav", "mp3", "flac"]


class ImageURLParam(OpenAIRequestModel):
    """``image_url`` of an ``image_url`` part: a ``data:image/...;base64,`` URL, or an http(s) URL the
    gateway fetches only when allowed to (``OMNIMODEL_MEDIA_FETCH``). ``detail`` is accepted and ignored."""

    url: Annotated[str, Field(min_length=1)]
    detail: Literal["auto", "low", "high"] | None = None


class AudioURLParam(OpenAIRequestModel):
    """``audio_url`` of an ``audio_url`` part (vLLM's): a ``data:audio/...;base64,`` URL of a whole audio
    file (what libsndfile reads: wav, flac, mp3, ogg), or an http(s) URL the gateway fetches only when
    allowed to (``OMNIMODEL_MEDIA_FETCH``)."""

    url: Annotated[str, Field(min_length=1)]


class VideoURLParam(OpenAIRequestModel):
    """``video_url`` of a ``video_url`` part: a ``data:video/...;base64,`` URL, or an http(s) URL the
    gateway fetches only when allowed to (``OMNIMODEL_MEDIA_FETCH``). ``num_frames`` (vLLM-Omni's client
    sends it): how many frames to take; by default 2 a second."""

    url: Annotated[str, Field(min_length=1)]
    num_frames: Annotated[int, Field(ge=1)] | None = None


class MMProcessorKwargs(OpenAIRequestModel):
    """vLLM's ``mm_processor_kwargs`` for Qwen2.5-Omni: ``use_audio_in_video`` takes each video's audio
    track as input too, interleaved with its frames. Other processor arguments are a 400 naming them
    (not ignored: the answer would not be the one asked for)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    use_audio_in_video: bool = False


class ContentPart(OpenAIRequestModel):
    """One part of a multi-part message: ``text``, ``input_audio`` (:class:`InputAudio`), ``audio_url``
    (:class:`AudioURLParam`), ``image_url`` (:class:`ImageURLParam`) or ``video_url``
    (:class:`VideoURLParam`). Any other type is kept
    (``extra="allow"``), and the media payloads are
    validated by the serving layer (``serving.media``), so that every problem with a part is a 400 whose
    ``param`` names the part (``messages[0].content[1]``): inside ``content``'s union a schema error
    would name the union's first member (``messages.0.content.str``) instead."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: str
    text: str | None = None
    input_audio: Any = None
    audio_url: Any = None
    image_url: Any = None
    video_url: Any = None


class ChatMessageParam(OpenAIRequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: Text | None = None

    @field_validator("content")
    @classmethod
    def _content_is_text(cls, content: str | list[ContentPart] | None) -> str | list[ContentPart] | None:
        # Checked on the whole field, not on ContentPart.text: inside the union an error would name the
        # union's first member (``messages.0.content.str``) instead of the content.
        if isinstance(content, str):
            unicode_text(content)
        for index, part in enumerate(content if isinstance(content, list) else ()):
            if part.text is not None:
                try:
                    unicode_text(part.text)
                except PydanticCustomError as err:
                    raise PydanticCustomError(
                        "string_unicode", "part {index}'s text {why}", {"index": index, "why": err.message()}
                    ) from None
        return content


class ChatAudioParam(OpenAIRequestModel):
    """OpenAI's ``audio`` request parameter: the voice (a speaker of the model) and the output format
    (``wav`` is a complete file; ``pcm16`` raw little-endian 16-bit samples; streams always send pcm16)."""

    voice: Annotated[str, Field(min_length=1)] | None = None
    format: Literal["wav", "pcm16"] = "wav"


class ResponseFormat(OpenAIRequestModel):
    """``response_format``: only ``text`` is served (no constrained decoding); the others are a 400."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


def _check_prompt_chars(chars: int) -> None:
    if chars > MAX_PROMPT_CHARS:
        raise PydanticCustomError(
            "prompt_too_long",
            "the prompt holds {chars} characters of text; this server takes at most {max}",
            {"chars": chars, "max": MAX_PROMPT_CHARS},
        )


def _bounded_text(messages: list[ChatMessageParam]) -> list[ChatMessageParam]:
    """``messages`` unless their text (string contents and text parts; media not counted) is longer
    than :data:`MAX_PROMPT_CHARS`."""
    total = 0
    for message in messages:
        if isinstance(message.content, str):
            total += len(message.content)
        for part in message.content if isinstance(message.content, list) else ():
            total += len(part.text or "")
    _check_prompt_chars(total)
    return messages


# A chat request's messages: at most OpenAI's 2048, with at most MAX_PROMPT_CHARS of text.
Messages = Annotated[
    list[ChatMessageParam], Field(min_length=1, max_length=MAX_MESSAGES), AfterValidator(_bounded_text)
]


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: Messages
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    logprobs: bool | None = None
    tools: list[dict[str, Any]] | None = None
    audio: ChatAudioParam | None = None
    # vLLM-Omni's ways of naming the voice (same meaning as ``audio.voice``): it reads ``voice``, then
    # ``speaker``, at the top level of the body.
    voice: Annotated[str, Field(min_length=1)] | None = None
    speaker: Annotated[str, Field(min_length=1)] | None = None
    # Refused unless neutral (serving.text): structured output, tool choice, legacy functions, logprobs.
    response_format: ResponseFormat | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # vLLM's extension (vLLM-Omni's clients send it for video with sound).
    mm_processor_kwargs: MMProcessorKwargs | None = None

    @property
    def effective_max_tokens(self) -> int | None:
        """``max_completion_tokens`` supersedes the deprecated ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class ChatCompletionAudio(OpenAIBaseModel):
    """``message.audio`` of a response with audio: ``data`` is base64 (a WAV file unless asked otherwise)."""

    id: str
    data: str
    expires_at: int
    transcript: str


class ChatMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None
    audio: ChatCompletionAudio | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int = 0
    message: ChatMessage
    logprobs: None = None
    finish_reason: str | None = "stop"


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None


class AudioDelta(OpenAIBaseModel):
    """A streamed piece of ``message.audio``: ``data`` is base64 raw PCM16 (24 kHz mono for Qwen-Omni)."""

    id: str
    data: str | None = None
    expires_at: int | None = None
    transcript: str | None = None


class AudioDeltaMessage(DeltaMessage):
    audio: AudioDelta | None = None


class AudioStreamChoice(OpenAIBaseModel):
    index: int = 0
    delta: AudioDeltaMessage
    logprobs: None = None
    finish_reason: str | None = None


class AudioChatCompletionStreamResponse(OpenAIBaseModel):
    """A chunk of a stream that carries audio; ``modality`` names what it carries (as vLLM-Omni does)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    modality: Literal["text", "audio"]
    choices: list[AudioStreamChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------- completions


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. One prompt per request: a string, a one-string list, or token ids."""

    prompt: str | list[str] | list[TokenId]
    # OpenAI's documented default for the legacy completions API.
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: Text | None = None
    # Refused above 1 (serving.text): one completion per request.
    best_of: Annotated[int, Field(ge=1)] | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _token_ids_in_range(cls, value: Any) -> Any:
        # Checked before the union is tried, so the error names ``prompt`` and the id rather than the
        # union's first member ("prompt.str: Input should be a valid string").
        if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            bad = next((t for t in value if not 0 <= t <= MAX_TOKEN_ID), None)
            if bad is not None:
                raise PydanticCustomError(
                    "token_id", "token ids must be between 0 and {max} (got {bad})", {"max": MAX_TOKEN_ID, "bad": bad}
                )
        return value

    @field_validator("prompt")
    @classmethod
    def _prompt_is_text(cls, value: str | list[str] | list[int]) -> str | list[str] | list[int]:
        texts = [text for text in ([value] if isinstance(value, str) else value) if isinstance(text, str)]
        for text in texts:
            unicode_text(text)
        _check_prompt_chars(sum(len(text) for text in texts))
        return value


class CompletionResponseChoice(OpenAIBaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = "stop"


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionResponseStreamChoice(OpenAIBaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------- models


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "omnimodel"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
