"""Walks the stage graph for one request: which stages it needs, and the frames that come back."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any

import numpy as np

from omnimodel_runtime.pipeline import Modality, Pipeline, Stage
from omnimodel_runtime.protocol.stage import (
    ErrorFrame,
    FinalFrame,
    ResponseFrame,
    StageInput,
    StageRequest,
    StageVoices,
)
from omnimodel_runtime.serving.errors import APIError
from omnimodel_runtime.stage.handle import StageHandle


class Orchestrator:
    """Routes requests through the stages of ``pipeline`` reachable via ``handles`` (local or remote).

    A request asks only for the stages its output modalities need (``Pipeline.stages_for``): text chat
    on an omni pipeline touches the thinker and never the talker or the vocoder. Every route walks the
    graph the same way, through :meth:`generate_chain`; a one-stage request is a chain of one.
    """

    def __init__(self, pipeline: Pipeline, handles: Mapping[str, StageHandle]) -> None:
        missing = [s.name for s in pipeline.stages if s.name not in handles]
        if missing:
            raise ValueError(f"no handle for stage(s) {', '.join(missing)}")
        self.pipeline = pipeline
        self.handles = dict(handles)

    @property
    def ready(self) -> bool:
        return all(h.ready for h in self.handles.values())

    def describe(self) -> dict[str, Any]:
        return {name: h.describe() for name, h in self.handles.items()}

    def plan(self, modalities: Iterable[Modality]) -> list[Stage]:
        """The stages a request for ``modalities`` visits, in graph order."""
        wanted = list(modalities)
        unserved = [m.value for m in wanted if m not in self.pipeline.modalities]
        if unserved:
            served = ", ".join(m.value for m in self.pipeline.modalities)
            raise APIError(
                f"model {self.pipeline.model.name!r} cannot output {', '.join(unserved)} (it outputs {served})",
                param="modalities",
            )
        return self.pipeline.stages_for(wanted)

    async def voices(self, stage: Stage) -> StageVoices | None:
        """The voices ``stage`` (the one reading a speech request's text) lists in its stage info."""
        return await self.handles[stage.name].voices()

    async def generate_chain(
        self,
        request: StageRequest,
        modalities: Iterable[Modality],
        *,
        tensors: Mapping[str, np.ndarray] | None = None,
    ) -> AsyncIterator[tuple[Stage, ResponseFrame]]:
        """Run every stage ``modalities`` need as one streaming chain; yield ``(stage, frame)`` for what
        the client gets.

        Each stage's frames feed the next stage as they are produced (stage k+1 starts on stage k's
        first frame: a talker on the thinker's first row, a vocoder on the first mel chunk), and the
        frames of an exit stage of a requested modality also go to the client — text deltas of a
        thinker while its talker is already running. The upstream's ``FinalFrame`` is passed on as the
        end-of-input marker. Client frames arrive in production order; every stage's ``FinalFrame`` is
        yielded too (the caller merges usage). On an ``ErrorFrame`` or a raised error the chain stops:
        the error is raised here, and every stage still running is cancelled (closing its stream aborts
        the request in the engine, or the HTTP request to a remote stage). ``tensors`` go with the
        request to the entry stage (a chat's media); later stages get the request alone.
        """
        wanted = list(modalities)
        stages = self.plan(wanted)
        for upstream, downstream in itertools.pairwise(stages):
            if downstream.inputs != (upstream.name,):
                raise APIError(
                    f"stage {downstream.name!r} takes {list(downstream.inputs)}; only linear chains are served",
                    status=501,
                    type="not_implemented",
                )
        exits = {s.name for s in stages if any(m in s.outputs for m in wanted)}
        out: asyncio.Queue[tuple[Stage, ResponseFrame] | BaseException | None] = asyncio.Queue()
        feeds: list[asyncio.Queue[ResponseFrame | None]] = [asyncio.Queue() for _ in stages[1:]]

        async def drain(queue: asyncio.Queue[ResponseFrame | None]) -> AsyncIterator[ResponseFrame]:
            while (frame := await queue.get()) is not None:
                yield frame

        async def pump(k: int) -> None:
            stage = stages[k]
            upstream = drain(feeds[k - 1]) if k > 0 else None
            feed = feeds[k] if k < len(feeds) else None
            given = (tensors or {}) if k == 0 else {}
            inp = StageInput(request=request, tensors=given, upstream=upstream)
            async for frame in self.handles[stage.name].generate(inp):
                if isinstance(frame, ErrorFrame):
                    raise frame.to_error()
                if feed is not None:
                    feed.put_nowait(frame)
                if stage.name in exits or isinstance(frame, FinalFrame):
                    out.put_nowait((stage, frame))
            # End of input for the next stage only after a clean finish: on failure the task group
            # cancels the downstream stages instead, so none of them reports an early, empty finish.
            if feed is not None:
                feed.put_nowait(None)

        async def run_all() -> None:
            try:
                async with asyncio.TaskGroup() as group:
                    for k in range(len(stages)):
                        group.create_task(pump(k))
            except BaseExceptionGroup as group_err:
                out.put_nowait(group_err.exceptions[0])
            else:
                out.put_nowait(None)

        runner = asyncio.create_task(run_all())
        try:
            while (item := await out.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            runner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await runner
