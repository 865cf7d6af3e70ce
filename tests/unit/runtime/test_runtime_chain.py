"""Multi-stage requests: each stage streams into the next, exit stages stream to the client.

Fake engines shaped like thinker -> talker -> code2wav, run in-process (LocalStage) and through stage
servers over the frame protocol (RemoteStage with streamed request bodies), all in memory.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import numpy as np
import pytest
from prometheus_client import CollectorRegistry
from runtime_fakes import fake_context, omni_pipeline, serve_on_loopback

from omnimodel_runtime.engines.base import Engine
from omnimodel_runtime.errors import StageError
from omnimodel_runtime.metrics import StageMetricsFamily
from omnimodel_runtime.pipeline import Modality, Pipeline
from omnimodel_runtime.protocol.stage import (
    FinalFrame,
    ResponseFrame,
    StageInput,
    StageRequest,
    TensorFrame,
    TextFrame,
    Usage,
)
from omnimodel_runtime.serving.orchestrator import Orchestrator
from omnimodel_runtime.settings import RuntimeSettings
from omnimodel_runtime.stage.handle import StageHandle
from omnimodel_runtime.stage.local import LocalStage
from omnimodel_runtime.stage.remote import RemoteStage
from omnimodel_runtime.stage.server import build_stage_app

TOKENS = 4


class Thinker(Engine):
    """Emits TOKENS text frames; after the first it waits for ``go`` (set once audio reached the client)."""

    go: asyncio.Event

    async def start(self) -> None:
        self.go = asyncio.Event()
        self.cancelled = False

    async def stop(self) -> None:
        pass

    async def generate(self, inp: StageInput) -> AsyncIterator[ResponseFrame]:
        try:
            for i in range(TOKENS):
                if "FAIL" in (inp.request.prompt or "") and i == 1:
                    raise StageError("thinker exploded", status=500)
                yield TextFrame(text=f" t{i}", token_ids=(i,))
                yield TensorFrame({"row": np.full((1, 3), i, dtype=np.float32)})
                if i == 0:
                    await self.go.wait()
            yield FinalFrame("stop", Usage(prompt_tokens=2, completion_tokens=TOKENS))
        except asyncio.CancelledError:
            self.cancelled = True
            raise


class Relay(Engine):
    """Turns each upstream tensor into one of its own (talker: rows -> codes; code2wav: codes -> audio)."""

    async def start(self) -> None:
        self.seen_final = False

    async def stop(self) -> None:
        pass

    async def generate(self, inp: StageInput) -> AsyncIterator[ResponseFrame]:
        assert inp.upstream is not None
        n = 0
        async for frame in inp.upstream:
            if isinstance(frame, TensorFrame):
                (arr,) = frame.tensors.values()
                yield TensorFrame({self.stage.name: arr * 2}, meta={"modality": "audio"})
                n += 1
            elif isinstance(frame, FinalFrame):
                self.seen_final = True
        yield FinalFrame("stop", Usage(completion_tokens=n))


def engines(pipeline: Pipeline) -> dict[str, Engine]:
    thinker, talker, code2wav = pipeline.stages
    return {
        "thinker": Thinker(fake_context(thinker)),
        "talker": Relay(fake_context(talker)),
        "code2wav": Relay(fake_context(code2wav)),
    }


async def local_handles(pipeline: Pipeline, stack: AsyncExitStack) -> tuple[dict[str, StageHandle], dict[str, Engine]]:
    family = StageMetricsFamily(CollectorRegistry())
    made = engines(pipeline)
    handles: dict[str, StageHandle] = {}
    for stage in pipeline.stages:
        handle = LocalStage(stage, made[stage.name], family.for_stage(stage.name))
        await handle.start()
        stack.push_async_callback(handle.stop)
        handles[stage.name] = handle
    return handles, made


async def remote_handles(pipeline: Pipeline, stack: AsyncExitStack) -> tuple[dict[str, StageHandle], dict[str, Engine]]:
    settings = RuntimeSettings(health_interval=3600)
    made = engines(pipeline)
    handles: dict[str, StageHandle] = {}
    for stage in pipeline.stages:
        url = await serve_on_loopback(build_stage_app(settings, pipeline, stage.name, engine=made[stage.name]), stack)
        remote = RemoteStage(stage.model_copy(update={"endpoints": (url,)}), settings)
        await remote.start()
        stack.push_async_callback(remote.stop)
        handles[stage.name] = remote
    return handles, made


@pytest.fixture(params=["local", "remote"])
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def chain(mode: str, stack: AsyncExitStack) -> tuple[Orchestrator, Thinker, dict[str, Engine]]:
    """The fake thinker -> talker -> code2wav chain, in process (``local``) or through stage servers
    (``remote``): its orchestrator, its thinker, and every engine."""
    pipeline = omni_pipeline()
    handles, made = await (local_handles if mode == "local" else remote_handles)(pipeline, stack)
    thinker = made["thinker"]
    assert isinstance(thinker, Thinker)
    return Orchestrator(pipeline, handles), thinker, made


async def test_audio_reaches_the_client_while_the_thinker_is_still_generating(mode: str) -> None:
    async with AsyncExitStack() as stack:
        orchestrator, thinker, made = await chain(mode, stack)
        request = StageRequest(request_id="r1", prompt="hi")
        got: list[tuple[str, str]] = []

        async def consume() -> None:
            async for stage, frame in orchestrator.generate_chain(request, [Modality.TEXT, Modality.AUDIO]):
                got.append((stage.name, type(frame).__name__))
                if stage.name == "code2wav" and isinstance(frame, TensorFrame):
                    # Only now may the thinker continue: had the chain waited for the thinker to
                    # finish, this frame could never arrive and the test would time out.
                    thinker.go.set()

        await asyncio.wait_for(consume(), timeout=10)

    texts = [i for i, (s, f) in enumerate(got) if s == "thinker" and f == "TextFrame"]
    audio = [i for i, (s, f) in enumerate(got) if s == "code2wav" and f == "TensorFrame"]
    assert len(texts) == TOKENS
    assert len(audio) == TOKENS
    assert audio[0] < texts[-1]  # first audio before the last text
    assert ("talker", "TensorFrame") not in got  # the talker is internal: its frames never reach the client
    assert sorted(s for s, f in got if f == "FinalFrame") == ["code2wav", "talker", "thinker"]
    relay = made["code2wav"]
    assert isinstance(relay, Relay)
    assert relay.seen_final


async def test_text_only_request_runs_only_the_thinker(mode: str) -> None:
    async with AsyncExitStack() as stack:
        orchestrator, thinker, _ = await chain(mode, stack)
        thinker.go.set()
        frames = [
            (s.name, f)
            async for s, f in orchestrator.generate_chain(StageRequest(request_id="r", prompt="x"), [Modality.TEXT])
        ]
    assert {name for name, _ in frames} == {"thinker"}
    assert "".join(f.text for _, f in frames if isinstance(f, TextFrame)) == " t0 t1 t2 t3"


async def test_an_upstream_failure_fails_the_request_and_stops_the_chain(mode: str) -> None:
    async with AsyncExitStack() as stack:
        orchestrator, thinker, _ = await chain(mode, stack)
        thinker.go.set()
        request = StageRequest(request_id="r", prompt="FAIL")
        with pytest.raises(StageError, match="thinker exploded"):
            async for _ in orchestrator.generate_chain(request, [Modality.TEXT, Modality.AUDIO]):
                pass


async def test_client_going_away_cancels_every_stage() -> None:
    async with AsyncExitStack() as stack:
        orchestrator, thinker, _ = await chain("local", stack)
        stream = orchestrator.generate_chain(StageRequest(request_id="r", prompt="x"), [Modality.AUDIO])
        async for stage, frame in stream:
            if stage.name == "code2wav" and isinstance(frame, TensorFrame):
                break  # the thinker is parked on `go`, mid-generation
        await stream.aclose()  # type: ignore[attr-defined]
        assert thinker.cancelled
