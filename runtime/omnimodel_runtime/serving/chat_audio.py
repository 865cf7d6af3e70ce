"""Chat completions with audio output: ``modalities`` containing ``"audio"``.

The request runs as one streaming chain (``Orchestrator.generate_chain``): thinker text deltas go to the
client as they come, the thinker's rows feed the talker, the talker's codes feed code2wav, and code2wav's
waveform comes back. Requests without audio never come here (``ChatService`` answers them; their chain is
the thinker alone, never the talker or code2wav).

- Non-streamed: the text, plus ``message.audio`` = ``{id, data: base64 WAV (24 kHz mono, 16-bit), expires_at,
  transcript}``. code2wav runs its whole-sequence path, which equals the whole model's waveform.
- Streamed: SSE chunks in production order, each naming its ``modality``: text deltas (``delta.content``)
  and audio chunks (``delta.audio.data``: base64 raw PCM16) interleaved as they are produced, so the first
  audio arrives while the text is still being written; then the finish chunk, the optional usage chunk and
  ``[DONE]``. code2wav runs chunked.

Voice: OpenAI's ``audio.voice`` or vLLM-Omni's ``voice``/``speaker``; the stages map it onto the model's speaker
map (``protocol.speech.resolve_voice``: OpenAI's voice names mean the default voice, an unknown voice is a 400
listing the voices, raised before any output).
"""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

import numpy as np

from omnimodel_runtime.errors import StageError
from omnimodel_runtime.pipeline import Modality, Pipeline, Stage
from omnimodel_runtime.protocol.openai import (
    AudioChatCompletionStreamResponse,
    AudioDelta,
    AudioDeltaMessage,
    AudioStreamChoice,
    ChatCompletionAudio,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatMessage,
    UsageInfo,
)
from omnimodel_runtime.protocol.stage import FinalFrame, ResponseFrame, StageParams, TensorFrame, TextFrame
from omnimodel_runtime.serving.audio import PCM_RATE, Resampler, resample, to_pcm16, wav_bytes
from omnimodel_runtime.serving.base import aclose
from omnimodel_runtime.serving.errors import APIError
from omnimodel_runtime.serving.sse import event_stream, sse
from omnimodel_runtime.serving.text import BaseChatService

log = logging.getLogger(__name__)

# Audio ids cannot be referenced in later turns (nothing is stored); the expiry says so honestly soon.
AUDIO_TTL_S: Final = 3600
DEFAULT_SAMPLE_RATE: Final = 24000


def wants_audio(req: ChatCompletionRequest) -> bool:
    return "audio" in (req.modalities or ())


def default_modalities(configured: Sequence[str], pipeline: Pipeline) -> tuple[Literal["text", "audio"], ...]:
    """What a chat request without ``modalities`` gets (``OMNIMODEL_CHAT_DEFAULT_MODALITIES``): the
    configured modalities this pipeline outputs; text when it outputs none of them."""
    outputs = {m.value for m in pipeline.modalities}
    chosen = tuple(m for m in ("text", "audio") if m in configured and m in outputs)
    return chosen or ("text",)


def with_default_modalities(
    req: ChatCompletionRequest, default: tuple[Literal["text", "audio"], ...]
) -> ChatCompletionRequest:
    """``req`` with ``default`` as its ``modalities`` when it names none."""
    if req.modalities is not None or default == ("text",):
        return req
    return req.model_copy(update={"modalities": list(default)})


def _visible(stage: Stage, frame: ResponseFrame) -> bool:
    """Whether ``frame`` is something the client sees (text, audio, or the text stage's end)."""
    if isinstance(frame, TextFrame | FinalFrame):
        return Modality.TEXT in stage.outputs
    return isinstance(frame, TensorFrame) and Modality.AUDIO in stage.outputs


@dataclass
class _Answer:
    """What the chain produced so far."""

    text: list[str] = field(default_factory=list)
    audio: list[np.ndarray] = field(default_factory=list)
    sample_rate: int = DEFAULT_SAMPLE_RATE
    finish_reason: str = "stop"
    usage: UsageInfo = field(default_factory=UsageInfo)

    def take(self, stage: Stage, frame: ResponseFrame) -> str | np.ndarray | None:
        """Record ``frame``; return the text delta or audio samples it carries for the client."""
        if isinstance(frame, TextFrame) and Modality.TEXT in stage.outputs:
            self.text.append(frame.text)
            return frame.text
        if isinstance(frame, TensorFrame) and Modality.AUDIO in stage.outputs and "audio" in frame.tensors:
            samples = np.asarray(frame.tensors["audio"], dtype=np.float32).reshape(-1)
            self.sample_rate = int(frame.meta.get("sample_rate", self.sample_rate))
            self.audio.append(samples)
            return samples
        if isinstance(frame, FinalFrame) and Modality.TEXT in stage.outputs:
            # The text stage's account is the one the client is billed by (text tokens in and out).
            self.finish_reason = frame.finish_reason
            u = frame.usage
            self.usage = UsageInfo(
                prompt_tokens=u.prompt_tokens,
                completion_tokens=u.completion_tokens,
                total_tokens=u.prompt_tokens + u.completion_tokens,
            )
        return None


class ChatAudioService(BaseChatService):
    """``/v1/chat/completions`` for requests that ask for audio."""

    @staticmethod
    def voice(req: ChatCompletionRequest) -> str | None:
        """The voice the request names: OpenAI's ``audio.voice`` or vLLM-Omni's top-level ``voice`` or
        ``speaker``; naming two different ones is a 400."""
        named = {
            "audio.voice": req.audio.voice if req.audio is not None else None,
            "voice": req.voice,
            "speaker": req.speaker,
        }
        given = [(where, name) for where, name in named.items() if name is not None]
        for where, name in given[1:]:
            if name.lower() != given[0][1].lower():
                raise APIError(
                    f"{given[0][0]} {given[0][1]!r} and {where} {name!r} name different voices; send one", param=where
                )
        return given[0][1] if given else None

    async def create(self, req: ChatCompletionRequest) -> ChatCompletionResponse | AsyncIterator[bytes]:
        request_id = self.request_id()
        base = await self.stage_input(req, request_id)
        params = StageParams(
            modalities=(Modality.TEXT, Modality.AUDIO), audio_chunked=req.stream, voice=self.voice(req)
        )
        stage_request = base.request.model_copy(update={"params": params})
        # The transcript is the thinker's text, so text is produced even when only audio is asked for.
        chain = self.orchestrator.generate_chain(stage_request, [Modality.TEXT, Modality.AUDIO], tensors=base.tensors)
        response_id, created = f"chatcmpl-{request_id}", int(time.time())
        audio_id = f"audio_{request_id}"
        audio_format = req.audio.format if req.audio is not None else "wav"
        if not req.stream:
            answer = _Answer()
            try:
                async for stage, frame in chain:
                    answer.take(stage, frame)
            finally:
                await aclose(chain)
            waveform = np.concatenate(answer.audio) if answer.audio else np.zeros(0, dtype=np.float32)
            if audio_format == "wav":
                data = wav_bytes(waveform, answer.sample_rate)
            else:  # OpenAI's pcm16 is 24 kHz, like the stream's deltas
                data = to_pcm16(resample(waveform, answer.sample_rate, PCM_RATE))
            text = "".join(answer.text)
            audio = ChatCompletionAudio(
                id=audio_id,
                data=base64.b64encode(data).decode(),
                expires_at=created + AUDIO_TTL_S,
                transcript=text,
            )
            return ChatCompletionResponse(
                id=response_id,
                created=created,
                model=self.model_name,
                choices=[
                    ChatCompletionResponseChoice(
                        message=ChatMessage(content=text, audio=audio), finish_reason=answer.finish_reason
                    )
                ],
                usage=answer.usage,
            )
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        return await self._stream(chain, response_id, created, audio_id, include_usage)

    async def _stream(
        self,
        chain: AsyncIterator[tuple[Stage, ResponseFrame]],
        response_id: str,
        created: int,
        audio_id: str,
        include_usage: bool,
    ) -> AsyncIterator[bytes]:
        # Wait for the first frame the client would see, so a request refused by a stage (unknown voice,
        # prompt too long) gets its 4xx status instead of a 200 stream that carries an error. (When the
        # thinker refuses, its downstream stages may still report an empty end first.)
        head: list[tuple[Stage, ResponseFrame]] = []
        while not head or not _visible(*head[-1]):
            item = await anext(chain, None)
            if item is None:
                if not head:
                    raise StageError("the pipeline returned no output", status=502)
                break
            head.append(item)

        def chunk(
            modality: str, delta: AudioDeltaMessage, finish: str | None = None, usage: UsageInfo | None = None
        ) -> bytes:
            choices = [] if usage is not None else [AudioStreamChoice(delta=delta, finish_reason=finish)]
            return sse(
                AudioChatCompletionStreamResponse(
                    id=response_id,
                    created=created,
                    model=self.model_name,
                    modality=modality,
                    choices=choices,
                    usage=usage,
                )
            )

        def audio_chunk(samples: np.ndarray) -> bytes:
            data = base64.b64encode(to_pcm16(samples)).decode()
            return chunk("audio", AudioDeltaMessage(audio=AudioDelta(id=audio_id, data=data)))

        async def events() -> AsyncGenerator[bytes, None]:
            answer = _Answer()
            # Deltas are raw PCM16 at OpenAI's 24 kHz, whatever rate the model speaks at.
            resampler: Resampler | None = None
            yield chunk("text", AudioDeltaMessage(role="assistant", content=""))
            item: tuple[Stage, ResponseFrame] | None = head.pop(0)
            while item is not None:
                piece = answer.take(*item)
                if isinstance(piece, str) and piece:
                    yield chunk("text", AudioDeltaMessage(content=piece))
                elif isinstance(piece, np.ndarray):
                    resampler = resampler or Resampler(answer.sample_rate, PCM_RATE)
                    if len(samples := resampler.push(piece)):
                        yield audio_chunk(samples)
                item = head.pop(0) if head else await anext(chain, None)
            if resampler is not None and len(samples := resampler.flush()):
                yield audio_chunk(samples)
            text = "".join(answer.text)
            yield chunk(
                "audio",
                AudioDeltaMessage(audio=AudioDelta(id=audio_id, expires_at=created + AUDIO_TTL_S, transcript=text)),
            )
            yield chunk("text", AudioDeltaMessage(), answer.finish_reason)
            if include_usage:
                yield chunk("text", AudioDeltaMessage(), usage=answer.usage)

        return event_stream(events(), chain)
