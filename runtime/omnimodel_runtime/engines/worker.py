"""The one mechanism for engines whose model work blocks: a worker thread fed by a queue.

Model calls are not thread-safe and compete for the same cores, so such an engine runs all of its model
work on ONE thread of its own, never on the event loop. The event loop validates a request, wraps it in
a :class:`Job`, submits it, and relays the frames the worker posts back. How the worker schedules its
jobs (continuous batching, round robin, one at a time, batches by shape) is each engine's own
:meth:`WorkerEngine.serve` loop; everything around that loop is here, the same for every engine:

- **start**: the thread runs :meth:`~WorkerEngine.load`, then :meth:`~WorkerEngine.serve`; ``start()``
  returns once the load has finished and raises what it raised.
- **frames back**: through ``call_soon_threadsafe``, the only way the worker touches asyncio objects
  (futures and queues are not thread-safe). :meth:`~WorkerEngine.emit` buffers and
  :meth:`~WorkerEngine.flush` hands a whole step's frames over in one wake-up: each hand-over costs a
  self-pipe write and a GIL switch, so a batch pays it per step, not per frame.
- **cancellation**: a caller that goes away sets ``job.cancelled`` (a plain attribute store, atomic
  under the GIL, the only field the event loop writes after submitting); the worker drops the job at
  its next step (:meth:`~WorkerEngine.check` raises :class:`CancelledRequestError` there).
- **stop**: ``stop()`` refuses new jobs and ends every request not finished, queued or running, with a
  503 "the engine is shutting down" (a running one at its next step, when its ``serve`` loop sees
  :attr:`~WorkerEngine.stopping`), then returns once the thread has exited.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import enum
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Final, Generic, TypeVar

from omnimodel_runtime.engines.base import Engine, EngineContext
from omnimodel_runtime.errors import StageError
from omnimodel_runtime.protocol.stage import ErrorFrame, FinalFrame, ResponseFrame, StageRequest, TextFrame

log = logging.getLogger(__name__)

SHUTTING_DOWN: Final = "the engine is shutting down"
PAST_DEADLINE: Final = "the request ran past its deadline"


class CancelledRequestError(Exception):
    """Raised on the worker (by :meth:`WorkerEngine.check`) when the caller of a job went away."""


@dataclass(eq=False, kw_only=True)
class Job:
    """One request inside a worker. Engines subclass it with what their worker needs; ``cancelled`` is
    the only field the event loop writes once the job is submitted."""

    request: StageRequest
    # Filled on the event loop only (frames go through WorkerEngine.emit/flush).
    out: asyncio.Queue[ResponseFrame] = field(default_factory=asyncio.Queue)
    cancelled: bool = False

    @property
    def expired(self) -> bool:
        deadline = self.request.deadline
        return deadline is not None and time.time() >= deadline


JobT = TypeVar("JobT", bound=Job)


class _Signal(enum.Enum):
    STOP = "stop"  # stop() was called: wakes a worker blocked on the inbox
    WAKE = "wake"  # re-evaluate what to run (a batch waiting for a request that will not come)


class WorkerEngine(Engine, Generic[JobT]):
    """An engine whose model work runs on one worker thread fed by a queue of ``JobT``."""

    def __init__(self, context: EngineContext) -> None:
        super().__init__(context)
        self._inbox: queue.Queue[JobT | _Signal] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = threading.Event()
        self._outbox: list[tuple[asyncio.Queue[ResponseFrame], ResponseFrame]] = []

    # ------------------------------------------------------------------ what an engine provides (worker)

    @abc.abstractmethod
    def load(self) -> None:
        """Load the model (on the worker thread, before any job)."""

    @abc.abstractmethod
    def serve(self) -> None:
        """Run jobs from :meth:`take` / :meth:`gather` until :attr:`stopping`, then return; jobs still
        held (a running batch) are answered with :meth:`refuse` first."""

    def worker_mode(self) -> AbstractContextManager[Any]:
        """A context the serve loop runs in (torch engines: ``torch.inference_mode()``)."""
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ life cycle (event loop)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping.clear()
        loaded: asyncio.Future[None] = self._loop.create_future()
        self._thread = threading.Thread(
            target=self._main, args=(self._loop, loaded), name=f"engine-{self.stage.name}", daemon=True
        )
        self._thread.start()
        await loaded

    async def stop(self) -> None:
        """Refuse new jobs, end every unfinished one with a 503, and wait for the worker to exit."""
        thread = self._thread
        if thread is None:
            return
        self._stopping.set()
        self._inbox.put(_Signal.STOP)
        await asyncio.to_thread(thread.join)
        self._thread = None

    def queue_depth(self) -> int:
        return self._inbox.qsize()

    # ------------------------------------------------------------------ submitting (event loop)

    def require_running(self) -> None:
        """A 503 unless the worker is up and not stopping."""
        if self._thread is None or self._loop is None:
            raise StageError("the engine is not running", status=503, type="service_unavailable")
        if self._stopping.is_set():
            raise StageError(SHUTTING_DOWN, status=503, type="service_unavailable")

    def submit(self, job: JobT) -> None:
        """Queue ``job`` for the worker."""
        self.require_running()
        self._inbox.put(job)

    def wake(self) -> None:
        """Make a worker waiting in :meth:`take` return (with nothing), so its loop looks again."""
        self._inbox.put(_Signal.WAKE)

    async def stream(self, job: JobT, *, merge_text: bool = False) -> AsyncGenerator[ResponseFrame, None]:
        """Submit ``job`` and relay its frames (:meth:`relay`)."""
        self.submit(job)
        async with contextlib.aclosing(self.relay(job, merge_text=merge_text)) as frames:
            async for frame in frames:
                yield frame

    async def relay(self, job: JobT, *, merge_text: bool = False) -> AsyncGenerator[ResponseFrame, None]:
        """The frames of a submitted ``job`` up to its ``FinalFrame``; an ``ErrorFrame`` is raised as
        ``StageError``. However the caller leaves (done, closed early, cancelled), the job is cancelled.

        ``merge_text``: a caller that fell behind (a slow client, a busy event loop) gets its backlog of
        text deltas as one frame, one write downstream instead of one per token (as vLLM's output
        collector merges deltas)."""
        frames = job.out
        held: ResponseFrame | None = None
        try:
            while True:
                frame = held if held is not None else await frames.get()
                held = None
                while merge_text and isinstance(frame, TextFrame) and not frames.empty():
                    nxt = frames.get_nowait()
                    if not isinstance(nxt, TextFrame):
                        held = nxt
                        break
                    frame = TextFrame(frame.text + nxt.text, frame.token_ids + nxt.token_ids)
                if isinstance(frame, ErrorFrame):
                    raise frame.to_error()
                yield frame
                if isinstance(frame, FinalFrame):
                    return
        finally:
            job.cancelled = True

    async def result(self, job: JobT) -> ResponseFrame:
        """Submit a job the worker answers with exactly one frame, and return that frame."""
        self.submit(job)
        try:
            frame = await job.out.get()
        finally:
            job.cancelled = True
        if isinstance(frame, ErrorFrame):
            raise frame.to_error()
        return frame

    # ------------------------------------------------------------------ taking jobs (worker)

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def take(self, timeout: float | None = None) -> JobT | None:
        """The next job, waiting up to ``timeout`` seconds (``None``: as long as it takes; 0 or less: not
        at all). ``None`` when none came, the worker was woken, or the engine is stopping."""
        if self._stopping.is_set():
            return None
        while True:
            try:
                if timeout is None:
                    item = self._inbox.get()
                elif timeout > 0:
                    item = self._inbox.get(timeout=timeout)
                else:
                    item = self._inbox.get_nowait()
            except queue.Empty:
                return None
            # A wake-up is for a worker that waits; one that only looks at what is queued looks on.
            if not (item is _Signal.WAKE and timeout is not None and timeout <= 0):
                break
        if isinstance(item, _Signal):
            return None
        if self._stopping.is_set():
            self.refuse(item)
            return None
        return item

    def gather(self, limit: int, *, block: bool, wait: float = 0.0) -> list[JobT]:
        """Up to ``limit`` jobs for the next step: with ``block``, wait for a first one as long as it
        takes, then up to ``wait`` seconds for more (a burst starts as one batch); without, only what is
        queued now. Fewer, or none, when the engine is stopping."""
        jobs: list[JobT] = []
        if limit <= 0:
            return jobs
        if block:
            first = self.take()
            if first is None:
                return jobs
            jobs.append(first)
        deadline = time.monotonic() + wait
        while len(jobs) < limit:
            job = self.take(deadline - time.monotonic())
            if job is None:
                break
            jobs.append(job)
        return jobs

    # ------------------------------------------------------------------ answering (worker)

    def emit(self, job: Job, frame: ResponseFrame) -> None:
        """Buffer ``frame`` for ``job``; it leaves with the next :meth:`flush`."""
        self._outbox.append((job.out, frame))

    def flush(self) -> None:
        """Hand every buffered frame to the event loop in one wake-up."""
        if not self._outbox or self._loop is None:
            return
        outbox, self._outbox = self._outbox, []
        _post(self._loop, _deliver, outbox)

    def send(self, job: Job, frame: ResponseFrame) -> None:
        """Hand ``frame`` over now (a job that streams one frame at a time)."""
        self.emit(job, frame)
        self.flush()

    def fail(self, job: Job, err: BaseException) -> None:
        """Answer ``job`` with ``err``: a ``StageError`` as it is, anything else as a logged 500."""
        if isinstance(err, StageError):
            self.emit(job, ErrorFrame.from_error(err))
            return
        log.error("Request %s failed in stage %s", job.request.request_id, self.stage.name, exc_info=err)
        self.emit(job, ErrorFrame(f"stage {self.stage.name!r} failed: {err}", status=500))

    def refuse(self, job: Job) -> None:
        """Answer ``job`` with the 503 of an engine that is shutting down."""
        self.emit(job, ErrorFrame(SHUTTING_DOWN, status=503, type="service_unavailable"))

    def drop_if_expired(self, job: Job) -> bool:
        """True, after answering it with a 504, when ``job`` ran past its deadline."""
        if not job.expired:
            return False
        self.emit(job, ErrorFrame(PAST_DEADLINE, status=504, type="timeout"))
        return True

    def check(self, job: Job) -> None:
        """Between two model steps of ``job``: raise when nobody wants it any more
        (:class:`CancelledRequestError`), the engine is stopping (a 503) or the deadline passed (a 504)."""
        if job.cancelled:
            raise CancelledRequestError
        if self._stopping.is_set():
            raise StageError(SHUTTING_DOWN, status=503, type="service_unavailable")
        if job.expired:
            raise StageError(PAST_DEADLINE, status=504, type="timeout")

    # ------------------------------------------------------------------ the thread

    def _main(self, loop: asyncio.AbstractEventLoop, loaded: asyncio.Future[None]) -> None:
        try:
            self.load()
        except BaseException as err:
            _post(loop, _set_exception, loaded, err)
            return
        _post(loop, _set_result, loaded)
        try:
            with self.worker_mode():
                self.serve()
        finally:
            # Whatever is still queued (behind the stop, or left when serve failed) gets its answer.
            while True:
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if not isinstance(item, _Signal):
                    self.refuse(item)
            self.flush()


def _post(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    """``call_soon_threadsafe`` that tolerates a loop already closed at shutdown (nobody listens then)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn, *args)


def _set_result(fut: asyncio.Future[None]) -> None:
    if not fut.done():  # its waiter may have given up (cancelled)
        fut.set_result(None)


def _set_exception(fut: asyncio.Future[None], err: BaseException) -> None:
    if not fut.done():
        fut.set_exception(err)


def _deliver(outbox: list[tuple[asyncio.Queue[ResponseFrame], ResponseFrame]]) -> None:
    for out, frame in outbox:
        out.put_nowait(frame)
