"""The engine base of the three Qwen2.5-Omni stages: a worker thread running one request at a time (the
modules keep per-call state such as ``rope_deltas`` during ``generate()``, so one instance must not run
two calls at once), fed the upstream stage's frames as they arrive; cancellation is a flag checked every
step (:class:`~omnimodel_runtime.engines.worker.WorkerEngine`)."""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import queue
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

import torch

from omnimodel_runtime.engines.base import EngineContext
from omnimodel_runtime.engines.devices import resolve_device, torch_dtype
from omnimodel_runtime.engines.worker import CancelledRequestError, Job, WorkerEngine
from omnimodel_runtime.protocol.stage import ResponseFrame, StageInput, StageRequest

log = logging.getLogger(__name__)

_END: Final = object()  # end of an upstream feed


@dataclass(eq=False, kw_only=True)
class OmniJob(Job):
    """One request inside an omni worker: its upstream feed and what ``prepare`` worked out (``data``).
    ``emit``, ``check`` and ``upstream`` are the worker's side of the job, through its engine."""

    engine: OmniEngine
    feed: queue.Queue[Any] = field(default_factory=queue.Queue)
    data: dict[str, Any] = field(default_factory=dict)

    def emit(self, frame: ResponseFrame) -> None:
        self.engine.send(self, frame)

    def check(self) -> None:
        self.engine.check(self)

    def upstream(self, poll: float = 0.05) -> Iterator[ResponseFrame]:
        """The upstream stage's frames, blocking until each arrives (checking for cancellation)."""
        while True:
            try:
                item = self.feed.get(timeout=poll)
            except queue.Empty:
                self.check()
                continue
            if item is _END:
                # The feed also ends when the request is abandoned (the pump is cancelled with it): that
                # is a cancellation here, not an upstream that finished.
                self.check()
                return
            if isinstance(item, BaseException):
                raise item
            yield item


class OmniEngine(WorkerEngine[OmniJob], abc.ABC):
    """A worker-thread engine running one Qwen2.5-Omni part, one request at a time (the modules keep
    per-call state such as ``rope_deltas`` during ``generate()``); subclasses load and run requests."""

    def __init__(self, context: EngineContext) -> None:
        super().__init__(context)
        self.args = dict(context.stage.engine_args)
        self.device = resolve_device(context.settings.device)
        self.dtype = torch_dtype(self.args.get("dtype"), self.device)
        self._current: OmniJob | None = None  # the job the worker is running

    # ------------------------------------------------------------ subclass hooks

    @abc.abstractmethod
    def load_part(self) -> None:
        """Load the part (worker thread, inference mode)."""

    def prepare(self, inp: StageInput, job: OmniJob) -> None:
        """Validate the request on the event loop (raise ``StageError`` 4xx); may fill ``job.data``."""

    def query(self, request: StageRequest) -> list[ResponseFrame] | None:
        """The answer to a request that asks about the engine rather than for work (e.g. the voices),
        given on the event loop without the worker; ``None`` for ordinary requests."""
        return None

    @abc.abstractmethod
    def run(self, job: OmniJob) -> None:
        """Serve one request on the worker thread, emitting frames; the worker adds nothing after it."""

    # ------------------------------------------------------------ the worker

    def worker_mode(self) -> contextlib.AbstractContextManager[Any]:
        return torch.inference_mode()

    def load(self) -> None:
        with torch.inference_mode():
            self.load_part()
        log.info("Loaded %s on %s for stage %s", type(self).__name__, self.device, self.stage.name)

    def serve(self) -> None:
        while (job := self.take()) is not None:
            if job.cancelled:
                continue
            self._current = job
            try:
                self.run(job)
            except CancelledRequestError:
                pass
            except Exception as err:  # a failed request fails itself, not the engine
                self.fail(job, err)
                self.flush()
            finally:
                self._current = None

    @property
    def busy(self) -> bool:
        """Whether the worker is running a request right now."""
        return self._current is not None

    # ------------------------------------------------------------ event loop

    async def generate(self, inp: StageInput) -> AsyncIterator[ResponseFrame]:
        self.require_running()
        answer = self.query(inp.request)
        if answer is not None:
            for frame in answer:
                yield frame
            return
        job = OmniJob(request=inp.request, engine=self)
        self.prepare(inp, job)
        pump = asyncio.create_task(self._pump(inp.upstream, job)) if inp.upstream is not None else None
        try:
            async with contextlib.aclosing(self.stream(job)) as frames:
                async for frame in frames:
                    yield frame
        finally:
            if pump is not None:
                pump.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pump

    @staticmethod
    async def _pump(upstream: AsyncIterator[ResponseFrame], job: OmniJob) -> None:
        """Move upstream frames into the worker's thread-safe feed as they arrive."""
        try:
            async for frame in upstream:
                job.feed.put(frame)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # the worker raises it where it waits for input
            job.feed.put(err)
        finally:
            job.feed.put(_END)
