"""The worker-thread mechanism every blocking engine shares (engines/worker.py), on a fake engine: jobs
stream back, a caller going away cancels its job, and ``stop()`` answers every unfinished request."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator

import pytest
from runtime_fakes import fake_context, text_pipeline

from omnimodel_runtime.engines.worker import CancelledRequestError, Job, WorkerEngine
from omnimodel_runtime.errors import StageError
from omnimodel_runtime.protocol.stage import FinalFrame, ResponseFrame, StageInput, StageRequest, TextFrame


class Steps(WorkerEngine[Job]):
    """One job at a time: a text frame per step until ``steps`` steps, checking the job between steps.
    A prompt of ``hold`` keeps stepping until the job is cancelled or the engine stops."""

    def __init__(self, *, fail_load: bool = False) -> None:
        super().__init__(fake_context(text_pipeline().entry))
        self.fail_load = fail_load
        self.loaded_on: str | None = None
        self.running = threading.Event()
        self.ended = threading.Event()
        self.outcomes: list[str] = []

    def load(self) -> None:
        self.loaded_on = threading.current_thread().name
        if self.fail_load:
            raise RuntimeError("no weights")

    def serve(self) -> None:
        while (job := self.take()) is not None:
            try:
                step = 0
                while job.request.prompt == "hold" or step < 3:
                    self.check(job)
                    self.send(job, TextFrame(f" s{step}"))
                    self.running.set()
                    step += 1
                    threading.Event().wait(0.01)
                self.send(job, FinalFrame("stop"))
                self.outcomes.append("done")
            except CancelledRequestError:
                self.outcomes.append("cancelled")
            except StageError as err:
                self.fail(job, err)
                self.flush()
                self.outcomes.append(f"failed {err.status}")
            self.ended.set()

    async def generate(self, inp: StageInput) -> AsyncIterator[ResponseFrame]:
        async with contextlib.aclosing(self.stream(Job(request=inp.request))) as frames:
            async for frame in frames:
                yield frame


def request(prompt: str) -> StageInput:
    return StageInput(request=StageRequest(request_id=prompt, prompt=prompt))


async def collect(engine: Steps, prompt: str) -> list[ResponseFrame]:
    return [frame async for frame in engine.generate(request(prompt))]


async def test_jobs_run_on_the_worker_thread_and_stream_back() -> None:
    engine = Steps()
    await engine.start()
    try:
        assert engine.loaded_on == "engine-llm"
        frames = await collect(engine, "go")
        assert frames == [TextFrame(" s0"), TextFrame(" s1"), TextFrame(" s2"), FinalFrame("stop")]
    finally:
        await engine.stop()


async def test_a_failed_load_fails_start() -> None:
    engine = Steps(fail_load=True)
    with pytest.raises(RuntimeError, match="no weights"):
        await engine.start()
    await engine.stop()


async def test_a_caller_going_away_cancels_its_job() -> None:
    engine = Steps()
    await engine.start()
    try:
        frames = engine.generate(request("hold"))
        assert await anext(frames) == TextFrame(" s0")
        await frames.aclose()  # type: ignore[attr-defined]
        assert await asyncio.to_thread(engine.ended.wait, 5)
        assert engine.outcomes == ["cancelled"]
        assert await collect(engine, "go")  # the worker goes on serving
    finally:
        await engine.stop()


async def test_stop_answers_the_running_and_the_queued_requests_with_a_503() -> None:
    engine = Steps()
    await engine.start()
    running = asyncio.create_task(collect(engine, "hold"))
    assert await asyncio.to_thread(engine.running.wait, 5)
    queued = asyncio.create_task(collect(engine, "go"))
    await asyncio.sleep(0)  # one turn of the loop: the task submits its job, then waits for frames
    assert engine.queue_depth() == 1
    async with asyncio.timeout(10):
        await engine.stop()
    for task in (running, queued):
        with pytest.raises(StageError, match="shutting down") as err:
            await task
        assert err.value.status == 503
    assert engine.outcomes == ["failed 503"]  # the running one stopped at its next step
    # A stopped engine refuses new work at once.
    with pytest.raises(StageError) as err:
        await collect(engine, "go")
    assert err.value.status == 503
