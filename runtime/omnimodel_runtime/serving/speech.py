"""Speech: ``/v1/audio/speech`` request -> stage request -> audio frames -> an audio file or a PCM stream.

The request runs the pipeline's audio chain (acoustic -> vocoder on the ``tts`` preset, thinker -> talker
-> code2wav on ``qwen2.5-omni``) as one streaming chain: the vocoder starts on the first mel chunk. A
chat model at the entry is told to speak the input verbatim (``StageParams.speak``), not to answer it. A
stream waits for the first audio before the HTTP response starts, so a request that fails early (unknown
voice, input too long, a stage down) still gets a proper status and error envelope, and the sample rate
is known for the ``X-Sample-Rate`` header. A failure after the first bytes cannot become an error body in
raw PCM: the stream is cut off, which a client sees as a truncated chunked response.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Final

import numpy as np

from omnimodel_runtime.errors import StageError
from omnimodel_runtime.pipeline import Modality, Stage
from omnimodel_runtime.protocol.speech import SpeechRequest, VoiceList
from omnimodel_runtime.protocol.stage import (
    ResponseFrame,
    SamplingParams,
    StageParams,
    StageRequest,
    TensorFrame,
)
from omnimodel_runtime.serving.audio import (
    MEDIA_TYPES,
    PCM_RATE,
    Resampler,
    encode_audio,
    encoded_rate,
    to_pcm16,
    unsupported_reason,
)
from omnimodel_runtime.serving.base import Service, aclose
from omnimodel_runtime.serving.errors import APIError

log = logging.getLogger(__name__)

SAMPLE_RATE_HEADER: Final = "x-sample-rate"


@dataclass(frozen=True)
class SpeechAudio:
    """What the route sends: a whole file (``body``) or a PCM stream (``stream``)."""

    media_type: str
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    stream: AsyncIterator[bytes] | None = None


def _audio(frame: ResponseFrame) -> np.ndarray | None:
    if isinstance(frame, TensorFrame) and "audio" in frame.tensors:
        return np.asarray(frame.tensors["audio"], dtype=np.float32).reshape(-1)
    return None


def _sample_rate(frame: ResponseFrame) -> int:
    assert isinstance(frame, TensorFrame)
    rate = frame.meta.get("sample_rate")
    if not isinstance(rate, int) or rate <= 0:
        raise StageError("the vocoder sent audio without a sample rate", status=502)
    return rate


class SpeechService(Service):
    """``/v1/audio/speech`` and ``/v1/audio/voices``."""

    @property
    def entry(self) -> Stage:
        """The stage that reads the text (and knows the voices)."""
        return self.orchestrator.plan([Modality.AUDIO])[0]

    def stage_request(self, req: SpeechRequest, request_id: str) -> tuple[StageRequest, str]:
        """Validate ``req``; return the stage request and the response format."""
        self.check_model(req.model)
        if not req.input.strip():
            raise APIError("input must contain text to speak", param="input")
        if req.instructions:
            raise APIError("instructions are not supported by this model", param="instructions")
        if req.stream_format == "sse":
            raise APIError(
                'stream_format "sse" is not supported; use stream_format "audio" (or stream: true) for raw PCM',
                param="stream_format",
            )
        if req.streamed:
            if req.response_format not in (None, "pcm"):
                raise APIError(
                    f"a streamed response is raw 16-bit PCM; response_format {req.response_format!r} cannot be "
                    "streamed (omit it or use pcm)",
                    param="response_format",
                )
            fmt = "pcm"
        else:
            fmt = req.response_format or "wav"
        reason = unsupported_reason(fmt)
        if reason is not None:
            raise APIError(reason, param="response_format")
        # A chat model at the entry (the Qwen2.5-Omni thinker) would answer the input: tell it to say it.
        params = StageParams(voice=req.voice_name, speed=req.speed, speak=Modality.TEXT in self.entry.outputs)
        request = StageRequest(
            request_id=request_id,
            prompt=req.input,
            sampling=SamplingParams(seed=req.seed),
            deadline=self.deadline(),
            stream=req.streamed,
            params=params,
        )
        return request, fmt

    async def create(self, req: SpeechRequest) -> SpeechAudio:
        """The whole audio file, or (streamed) the PCM body once its first bytes exist."""
        request, fmt = self.stage_request(req, self.request_id())
        chain = self.orchestrator.generate_chain(request, [Modality.AUDIO])
        if not req.streamed:
            try:
                waveform, rate = await self._collect(chain)
            finally:
                await aclose(chain)
            try:
                # Encoding minutes of mp3 takes a while: not on the event loop.
                encoded = await asyncio.to_thread(encode_audio, waveform, rate, fmt)
            except ValueError as err:
                raise APIError(str(err), param="response_format") from err
            headers = {SAMPLE_RATE_HEADER: str(encoded_rate(rate, fmt))}
            return SpeechAudio(media_type=MEDIA_TYPES[fmt], headers=headers, body=encoded)

        try:
            first, rate = await self._first_audio(chain)
        except BaseException:
            await aclose(chain)
            raise

        # Raw PCM at OpenAI's rate, the same samples as the whole pcm response (Resampler streams exactly).
        resampler = Resampler(rate, PCM_RATE)

        async def body() -> AsyncIterator[bytes]:
            try:
                if len(samples := resampler.push(first)):
                    yield to_pcm16(samples)
                async for _, frame in chain:
                    audio = _audio(frame)
                    if audio is not None and len(samples := resampler.push(audio)):
                        yield to_pcm16(samples)
                if len(samples := resampler.flush()):
                    yield to_pcm16(samples)
            finally:
                with contextlib.suppress(Exception):
                    await aclose(chain)

        headers = {SAMPLE_RATE_HEADER: str(PCM_RATE), "x-audio-channels": "1", "x-audio-encoding": "s16le"}
        return SpeechAudio(media_type=MEDIA_TYPES["pcm"], headers=headers, stream=body())

    async def _first_audio(self, chain: AsyncIterator[tuple[Stage, ResponseFrame]]) -> tuple[np.ndarray, int]:
        async for _, frame in chain:
            audio = _audio(frame)
            if audio is not None:
                return audio, _sample_rate(frame)
        raise StageError("the pipeline returned no audio", status=502)

    async def _collect(self, chain: AsyncIterator[tuple[Stage, ResponseFrame]]) -> tuple[np.ndarray, int]:
        parts: list[np.ndarray] = []
        rate: int | None = None
        async for _, frame in chain:
            audio = _audio(frame)
            if audio is not None:
                rate = rate or _sample_rate(frame)
                parts.append(audio)
        if rate is None:
            raise StageError("the pipeline returned no audio", status=502)
        return np.concatenate(parts), rate

    async def voices(self) -> VoiceList:
        """The voices the entry stage lists in its stage info (``/v1/stage/info`` of a stage process)."""
        voices = await self.orchestrator.voices(self.entry)
        if voices is None:
            raise APIError(f"stage {self.entry.name!r} does not list voices", status=501, type="not_implemented")
        return VoiceList(voices=list(voices.names), default=voices.default)
