"""Wire models of ``/v1/audio/speech`` and ``/v1/audio/voices`` (OpenAI's speech API plus the
extensions vLLM-Omni also accepts: ``stream``, ``seed``).

Every field the server acts on is validated here, so a bad value is a 400 naming the field. Whether a
*known* format can be encoded (mp3/opus need libsndfile) is decided by the serving layer, which names the
format in its 400; ``aac`` is in OpenAI's list but not in this schema, and gets a 400 that says why.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Final, Literal

from pydantic import Field, field_validator
from pydantic_core import PydanticCustomError

from omnimodel_runtime.errors import StageError
from omnimodel_runtime.protocol.openai import OpenAIBaseModel, OpenAIRequestBody, OpenAIRequestModel, Seed, Text

# OpenAI's documented limit on ``input``; the acoustic stage has its own, in tokens.
MAX_INPUT_CHARS: Final = 4096
# The speeds every speech stage can produce (its time-stretch of the mel frames); stages check them again.
MIN_SPEED: Final = 0.25
MAX_SPEED: Final = 4.0

SpeechFormat = Literal["wav", "pcm", "flac", "mp3", "opus"]
# In OpenAI's list, but there is no maintained AAC encoder library to rely on: refused with its reason.
REFUSED_FORMATS: Final = {"aac": "no maintained AAC encoder library is available here"}


# OpenAI's built-in voices. Its SDK makes clients name one (``audio={"voice": ...}`` on chat, ``voice`` on
# speech) and vLLM-Omni ignores ``audio.voice`` on chat, so clients written for either send "alloy" to a
# model that has no such speaker: they get the model's default voice (unless it has a speaker of that
# name). Any other unknown name is a 400 listing the model's voices.
OPENAI_VOICES: Final = frozenset(
    {"alloy", "ash", "ballad", "cedar", "coral", "echo", "fable", "marin", "nova", "onyx", "sage", "shimmer", "verse"}
)
# The speech API's name for "no particular voice" (vLLM-Omni's placeholder too).
DEFAULT_VOICE_NAME: Final = "default"


def resolve_voice(voice: str | None, names: Iterable[str], default: str, *, param: str) -> str:
    """The model's speaker for ``voice``: its own name (case-insensitive, as vLLM-Omni matches), else the
    ``default`` for no voice, ``"default"`` or an OpenAI voice name; otherwise a 400 naming ``param`` and
    listing the voices."""
    names = list(names)
    if voice is None:
        return default
    for name in names:
        if name.lower() == voice.lower():
            return name
    if voice.lower() == DEFAULT_VOICE_NAME or voice.lower() in OPENAI_VOICES:
        return default
    raise StageError(
        f"unknown voice {voice!r}; this model speaks with: {', '.join(names)} "
        f"(OpenAI's voice names and {DEFAULT_VOICE_NAME!r} mean {default!r})",
        status=400,
        param=param,
    )


class VoiceRef(OpenAIRequestModel):
    """A voice given as an object (``{"id": "..."}``), as newer OpenAI clients may send it."""

    id: Annotated[str, Field(min_length=1, max_length=64)]


class SpeechRequest(OpenAIRequestBody):
    """``POST /v1/audio/speech``."""

    model: str | None = None
    # Not Text: pydantic checks a length-constrained string as UTF-8 itself (a lone surrogate is a 400 here).
    input: Annotated[str, Field(min_length=1, max_length=MAX_INPUT_CHARS)]
    voice: Annotated[str, Field(min_length=1, max_length=64)] | VoiceRef = "default"
    instructions: Text | None = None
    # None: wav for a whole response (vLLM-Omni's default; OpenAI's is mp3), pcm for a stream.
    response_format: SpeechFormat | None = None
    speed: Annotated[float, Field(ge=MIN_SPEED, le=MAX_SPEED)] = 1.0
    # Stream raw 16-bit little-endian mono PCM at 24 kHz (as OpenAI's pcm) as it is synthesised.
    stream: bool = False
    # OpenAI's switch: "audio" streams raw audio bytes like ``stream``; "sse" is not served.
    stream_format: Literal["audio", "sse"] | None = None
    # The acoustic model samples (prenet dropout): the same seed gives the same audio.
    seed: Seed | None = None

    @field_validator("response_format", mode="before")
    @classmethod
    def _known_but_refused(cls, value: object) -> object:
        if isinstance(value, str) and value in REFUSED_FORMATS:
            raise PydanticCustomError(
                "unsupported_format",
                "'{fmt}' is not supported: {why} (this server encodes wav, pcm, flac, mp3 and opus)",
                {"fmt": value, "why": REFUSED_FORMATS[value]},
            )
        return value

    @property
    def voice_name(self) -> str:
        return self.voice if isinstance(self.voice, str) else self.voice.id

    @property
    def streamed(self) -> bool:
        return self.stream or self.stream_format == "audio"


class VoiceList(OpenAIBaseModel):
    """``GET /v1/audio/voices``: the speaker names the model ships, and the one used when none is given."""

    voices: list[str]
    default: str
