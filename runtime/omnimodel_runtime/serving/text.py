"""Chat and text completions: OpenAI request -> stage request -> frames -> OpenAI response or SSE.

Streams wait for the first frame before the HTTP response starts, so a request that fails early (a
stage is down, the prompt is too long) still gets a proper status code and error envelope. Once the
stream has started, a failure becomes an error chunk followed by ``data: [DONE]``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass

from pydantic import BaseModel

from omnimodel_runtime.errors import StageError
from omnimodel_runtime.pipeline import Modality
from omnimodel_runtime.protocol.openai import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
    UsageInfo,
    stop_list,
)
from omnimodel_runtime.protocol.stage import (
    FinalFrame,
    ResponseFrame,
    SamplingParams,
    StageInput,
    StageRequest,
    TextFrame,
)
from omnimodel_runtime.serving.base import Service, aclose, frames_of
from omnimodel_runtime.serving.errors import APIError
from omnimodel_runtime.serving.media import NO_FETCH, MediaPolicy, chat_content
from omnimodel_runtime.serving.orchestrator import Orchestrator
from omnimodel_runtime.serving.sse import event_stream, sse


@dataclass(frozen=True)
class Collected:
    text: str
    finish_reason: str
    usage: UsageInfo


def _usage(frame: FinalFrame) -> UsageInfo:
    u = frame.usage
    return UsageInfo(
        prompt_tokens=u.prompt_tokens,
        completion_tokens=u.completion_tokens,
        total_tokens=u.prompt_tokens + u.completion_tokens,
    )


async def _first(frames: AsyncIterator[ResponseFrame], stage_hint: str) -> ResponseFrame:
    try:
        return await anext(frames)
    except StopAsyncIteration:
        raise StageError(f"{stage_hint} returned no output", status=502) from None


async def collect(frames: AsyncIterator[ResponseFrame]) -> Collected:
    """Run a request to completion and join its text."""
    parts: list[str] = []
    try:
        async for frame in frames:
            if isinstance(frame, TextFrame):
                parts.append(frame.text)
            elif isinstance(frame, FinalFrame):
                return Collected("".join(parts), frame.finish_reason, _usage(frame))
    finally:
        await aclose(frames)
    raise StageError("the stage ended the response without finishing it", status=502)


class TextService(Service):
    """What chat and completions share: validation, stage requests, collecting and streaming."""

    def check_common(self, req: ChatCompletionRequest | CompletionRequest) -> None:
        self.check_model(req.model)
        if req.n != 1:
            raise APIError("only n=1 is supported", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(req, name):
                raise APIError(f"{name} is not supported (send 0 or leave it out)", param=name)
        if req.logit_bias:
            raise APIError("logit_bias is not supported", param="logit_bias")

    def sampling(self, req: ChatCompletionRequest | CompletionRequest, max_tokens: int | None) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            seed=req.seed,
            stop=stop_list(req.stop),
            ignore_eos=req.ignore_eos,
        )

    async def stream(
        self,
        frames: AsyncIterator[ResponseFrame],
        *,
        head: list[bytes],
        delta: Callable[[str], BaseModel],
        final: Callable[[str], BaseModel],
        usage: Callable[[UsageInfo], BaseModel] | None,
    ) -> AsyncIterator[bytes]:
        """SSE body: ``head`` chunks, one chunk per non-empty text delta, the finish chunk, optionally a
        usage chunk, then ``[DONE]``. The first frame is awaited before returning, so an early failure
        raises here (and becomes an HTTP error) instead of inside a 200 stream."""
        first = await _first(frames, "the stage")

        async def events() -> AsyncGenerator[bytes, None]:
            for chunk in head:
                yield chunk
            frame: ResponseFrame = first
            while True:
                if isinstance(frame, TextFrame):
                    if frame.text:
                        yield sse(delta(frame.text))
                elif isinstance(frame, FinalFrame):
                    yield sse(final(frame.finish_reason))
                    if usage is not None:
                        yield sse(usage(_usage(frame)))
                    return
                frame = await _first(frames, "the stage")

        return event_stream(events(), frames)


class BaseChatService(TextService):
    """What chat with text answers and chat with audio answers share: a chat request checked and
    translated for the entry stage."""

    def __init__(self, orchestrator: Orchestrator, *, request_timeout: float, media: MediaPolicy = NO_FETCH) -> None:
        super().__init__(orchestrator, request_timeout=request_timeout)
        self.media = media

    async def stage_input(self, req: ChatCompletionRequest, request_id: str) -> StageInput:
        """Validate ``req`` and translate it for the entry stage: the request, and the bytes of its media
        (audio, images and video; remote images and videos fetched when the media policy allows)."""
        self.check_common(req)
        if req.logprobs:
            raise APIError("logprobs are not supported", param="logprobs")
        if req.tools:
            raise APIError("tool calling is not supported", param="tools")
        if req.tool_choice not in (None, "none", "auto"):
            raise APIError("tool calling is not supported", param="tool_choice")
        if req.functions or req.function_call not in (None, "none", "auto"):
            raise APIError("function calling is not supported", param="functions" if req.functions else "function_call")
        if req.top_logprobs:
            raise APIError("logprobs are not supported", param="top_logprobs")
        if req.response_format is not None and req.response_format.type != "text":
            raise APIError(
                f"response_format {req.response_format.type!r} is not supported (no constrained decoding); "
                "only 'text' is served",
                param="response_format",
            )
        content = chat_content(
            req.messages,
            accepts=self.orchestrator.pipeline.input_modalities,
            model=self.model_name,
            policy=self.media,
            use_audio_in_video=req.mm_processor_kwargs is not None and req.mm_processor_kwargs.use_audio_in_video,
        )
        await content.fetch(self.media)
        request = StageRequest(
            request_id=request_id,
            messages=content.messages,
            media=content.media,
            sampling=self.sampling(req, req.effective_max_tokens),
            deadline=self.deadline(),
            stream=req.stream,
        )
        return StageInput(request=request, tensors=content.tensors)


class ChatService(BaseChatService):
    """``/v1/chat/completions`` answered with text."""

    def modalities(self, req: ChatCompletionRequest) -> list[Modality]:
        return [Modality(m) for m in (req.modalities or ["text"])]

    async def create(self, req: ChatCompletionRequest) -> ChatCompletionResponse | AsyncIterator[bytes]:
        """A full response, or (``stream=true``) the SSE body."""
        request_id = self.request_id()
        inp = await self.stage_input(req, request_id)
        frames = frames_of(self.orchestrator.generate_chain(inp.request, self.modalities(req), tensors=inp.tensors))
        response_id, created = f"chatcmpl-{request_id}", int(time.time())
        if not req.stream:
            result = await collect(frames)
            return ChatCompletionResponse(
                id=response_id,
                created=created,
                model=self.model_name,
                choices=[
                    ChatCompletionResponseChoice(
                        message=ChatMessage(content=result.text), finish_reason=result.finish_reason
                    )
                ],
                usage=result.usage,
            )

        def chunk(delta: DeltaMessage, finish: str | None = None) -> ChatCompletionStreamResponse:
            choice = ChatCompletionResponseStreamChoice(delta=delta, finish_reason=finish)
            return ChatCompletionStreamResponse(
                id=response_id, created=created, model=self.model_name, choices=[choice]
            )

        include_usage = req.stream_options is not None and req.stream_options.include_usage
        return await self.stream(
            frames,
            head=[sse(chunk(DeltaMessage(role="assistant", content="")))],
            delta=lambda text: chunk(DeltaMessage(content=text)),
            final=lambda reason: chunk(DeltaMessage(), reason),
            usage=(
                (
                    lambda u: ChatCompletionStreamResponse(
                        id=response_id, created=created, model=self.model_name, choices=[], usage=u
                    )
                )
                if include_usage
                else None
            ),
        )


class CompletionService(TextService):
    """``/v1/completions`` (legacy text completions), one prompt per request."""

    def stage_request(self, req: CompletionRequest, request_id: str) -> StageRequest:
        self.check_common(req)
        if req.echo:
            raise APIError("echo is not supported", param="echo")
        if req.logprobs is not None:
            raise APIError("logprobs are not supported", param="logprobs")
        if req.suffix is not None:
            raise APIError("suffix is not supported", param="suffix")
        if req.best_of not in (None, 1):
            raise APIError("best_of is not supported (one completion per request)", param="best_of")
        prompt: str | None = None
        token_ids: tuple[int, ...] | None = None
        if isinstance(req.prompt, str):
            prompt = req.prompt
        elif req.prompt and all(isinstance(p, str) for p in req.prompt):
            if len(req.prompt) != 1:
                raise APIError("send one prompt per request (batched prompts are not supported)", param="prompt")
            prompt = str(req.prompt[0])
        else:
            token_ids = tuple(int(t) for t in req.prompt)
        if (prompt is not None and not prompt) or (token_ids is not None and not token_ids):
            raise APIError("prompt must not be empty", param="prompt")
        return StageRequest(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=token_ids,
            sampling=self.sampling(req, req.max_tokens),
            deadline=self.deadline(),
            stream=req.stream,
        )

    async def create(self, req: CompletionRequest) -> CompletionResponse | AsyncIterator[bytes]:
        request_id = self.request_id()
        stage_request = self.stage_request(req, request_id)
        frames = frames_of(self.orchestrator.generate_chain(stage_request, [Modality.TEXT]))
        response_id, created = f"cmpl-{request_id}", int(time.time())
        if not req.stream:
            result = await collect(frames)
            return CompletionResponse(
                id=response_id,
                created=created,
                model=self.model_name,
                choices=[CompletionResponseChoice(text=result.text, finish_reason=result.finish_reason)],
                usage=result.usage,
            )

        def chunk(text: str, finish: str | None = None) -> CompletionStreamResponse:
            choice = CompletionResponseStreamChoice(text=text, finish_reason=finish)
            return CompletionStreamResponse(id=response_id, created=created, model=self.model_name, choices=[choice])

        include_usage = req.stream_options is not None and req.stream_options.include_usage
        return await self.stream(
            frames,
            head=[],
            delta=chunk,
            final=lambda reason: chunk("", reason),
            usage=(
                (
                    lambda u: CompletionStreamResponse(
                        id=response_id, created=created, model=self.model_name, choices=[], usage=u
                    )
                )
                if include_usage
                else None
            ),
        )
