"""The engine base of the three Qwen2.5-Omni stages: a worker thread fed the upstream stage's frames as they
arrive; cancellation is a flag checked every step (:class:`~omnimodel_runtime.engines.worker.WorkerEngine`).

Two ways to serve, chosen per stage by ``engine_args.batching`` (default: on for accelerators, off on CPU):

- **one request at a time** (:meth:`OmniEngine.run`): Hugging Face's own ``generate()`` per request, bit
  for bit the whole model's output (the modules keep per-call state such as ``rope_deltas`` during
  ``generate()``, so one instance runs one call at a time);
- **batched** (:meth:`OmniEngine.advance`): every running request advances together, one step of each
  per iteration (one batched decode step over static per-request caches, one DiT pass over several
  requests' chunks). A request waiting for upstream input simply sits out the steps until it has it;
  the loop sleeps only when no request can move, and any frame arriving upstream wakes it.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import queue
import secrets
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import torch

from omnimodel_runtime.engines.base import EngineContext, EngineWork, flag
from omnimodel_runtime.engines.devices import resolve_device, sdpa_backends, torch_dtype
from omnimodel_runtime.engines.slots import new_stream, on_stream
from omnimodel_runtime.engines.worker import CancelledRequestError, Job, WorkerEngine
from omnimodel_runtime.errors import StageError
from omnimodel_runtime.protocol.stage import FinalFrame, ResponseFrame, StageInput, StageParams, StageRequest

log = logging.getLogger(__name__)

_END: Final = object()  # end of an upstream feed
# engine_args.prefill_attention's default on CUDA: every kernel but cuDNN's (see OmniEngine.__init__).
PREFILL_ATTENTION_CUDA: Final = "flash,efficient,math"


class WorkClock:
    """The worker's busy seconds and its requests' queue wait (:class:`EngineWork`), for the stage's metrics.

    Busy is the time inside :meth:`working` spans (a batched step, a request served whole) less the
    :meth:`idle` spans inside them (waiting for upstream frames); a scrape on the event loop reads the span
    in progress too, so a level of the bench sees its own seconds and no more. The lock keeps a reading from
    catching a span half closed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy = 0.0
        self._since: float | None = None  # start of the busy span in progress
        self._admitted = 0
        self._queue_wait = 0.0

    def _close(self, now: float) -> None:
        if self._since is not None:
            self._busy += now - self._since
            self._since = None

    @contextlib.contextmanager
    def working(self) -> Iterator[None]:
        with self._lock:
            self._since = time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                self._close(time.monotonic())

    @contextlib.contextmanager
    def idle(self) -> Iterator[None]:
        with self._lock:
            paused = self._since is not None
            self._close(time.monotonic())
        try:
            yield
        finally:
            if paused:
                with self._lock:
                    self._since = time.monotonic()

    def admitted(self, job: OmniJob) -> None:
        """``job`` left the queue for the worker."""
        with self._lock:
            self._admitted += 1
            self._queue_wait += time.monotonic() - job.submitted

    def read(self) -> EngineWork:
        with self._lock:
            busy = self._busy + (time.monotonic() - self._since if self._since is not None else 0.0)
            return EngineWork(busy_seconds=busy, admitted=self._admitted, queue_wait_seconds=self._queue_wait)


@dataclass(eq=False, kw_only=True)
class OmniJob(Job):
    """One request inside an omni worker: its upstream feed and what ``prepare`` worked out (``data``).
    ``emit``, ``check`` and ``upstream`` are the worker's side of the job, through its engine."""

    engine: OmniEngine
    feed: queue.Queue[Any] = field(default_factory=queue.Queue)
    data: dict[str, Any] = field(default_factory=dict)
    # Batched serving: whether the upstream feed has ended (set by ``poll``) and the stage's own state.
    ended: bool = False
    state: Any = None
    submitted: float = 0.0  # time.monotonic() when the worker's queue got it

    def emit(self, frame: ResponseFrame) -> None:
        engine = self.engine
        (engine.emit if engine.holding else engine.send)(self, frame)

    def check(self) -> None:
        self.engine.check(self)

    def upstream(self, poll: float = 0.05) -> Iterator[ResponseFrame]:
        """The upstream stage's frames, blocking until each arrives (checking for cancellation)."""
        while True:
            try:
                with self.engine.clock.idle():
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

    def poll(self) -> list[ResponseFrame]:
        """The upstream frames that have arrived, without waiting (batched serving); sets ``ended`` once
        the feed has ended."""
        out: list[ResponseFrame] = []
        while not self.ended:
            try:
                item = self.feed.get_nowait()
            except queue.Empty:
                break
            if item is _END:
                self.check()
                self.ended = True
            elif isinstance(item, BaseException):
                raise item
            else:
                out.append(item)
        return out


def batching_default(args: dict[str, Any], device: str) -> bool:
    """``engine_args.batching``, by default on wherever the engine runs on an accelerator."""
    return flag(args, "batching", default=torch.device(device).type != "cpu")


class OmniEngine(WorkerEngine[OmniJob], abc.ABC):
    """A worker-thread engine running one Qwen2.5-Omni part, one request at a time (the modules keep
    per-call state such as ``rope_deltas`` during ``generate()``); subclasses load and run requests."""

    def __init__(self, context: EngineContext) -> None:
        super().__init__(context)
        self.args = dict(context.stage.engine_args)
        self.device = resolve_device(context.settings.device)
        self.dtype = torch_dtype(self.args.get("dtype"), self.device)
        self.batched = batching_default(self.args, self.device)
        self.graphs = torch.device(self.device).type == "cuda" and flag(self.args, "cuda_graphs", default=True)
        # torch.compile before the graphs are captured (the slot decoders' layers, code2wav's DiT blocks).
        self.compiled = flag(self.args, "compile", default=self.graphs)
        self.max_batch = int(self.args.get("max_batch_size", 8))
        # The attention kernels of the stages' generate() calls (the batched path's prefills; every step of a
        # request served one at a time). On CUDA torch prefers cuDNN's, which builds a plan for each new
        # sequence length: 49-74 ms on an H200 at the thinker's and the talker's shapes, paid twice by every
        # prompt of a new length before its first audio; flash attention takes ~0.1 ms (bench/sdpa_shapes.py).
        default = PREFILL_ATTENTION_CUDA if torch.device(self.device).type == "cuda" else "auto"
        self.prefill_attention = sdpa_backends(
            self.args.get("prefill_attention", default), "engine_args.prefill_attention"
        )
        self._current: OmniJob | None = None  # the job the worker is running (one at a time)
        self._active: list[OmniJob] = []  # the jobs the worker is running (batched)
        self._wake = threading.Event()  # set when a job or an upstream frame arrives
        self._stream_priority = 0  # the talker and thinker ask for a higher one (lower number)
        self._stream: Any = None
        self.holding = False  # inside one_wake_up(): frames wait for its end
        self.clock = WorkClock()

    @contextlib.contextmanager
    def one_wake_up(self) -> Iterator[None]:
        """Frames emitted inside leave together at the end: a batched step's frames for every request in
        one event-loop wake-up, not one each (the loop thread competes for the GIL with the workers)."""
        self.holding = True
        try:
            yield
        finally:
            self.holding = False
            self.flush()

    # ------------------------------------------------------------ subclass hooks

    @abc.abstractmethod
    def load_part(self) -> None:
        """Load the part (worker thread, inference mode)."""

    def prepare(self, inp: StageInput, job: OmniJob) -> None:
        """Validate the request on the event loop (raise ``StageError`` 4xx); may fill ``job.data``."""

    async def admit(self, inp: StageInput, job: OmniJob) -> None:
        """What the event loop does with a request before the worker gets it: :meth:`prepare`, and in an
        engine whose validation has blocking work (decoding media) that work on a thread first."""
        self.prepare(inp, job)

    def query(self, request: StageRequest) -> list[ResponseFrame] | None:
        """The answer to a request that asks about the engine rather than for work (e.g. the voices),
        given on the event loop without the worker; ``None`` for ordinary requests."""
        return None

    @abc.abstractmethod
    def run(self, job: OmniJob) -> None:
        """Serve one request on the worker thread, emitting frames; the worker adds nothing after it."""

    def advance(self, jobs: list[OmniJob]) -> tuple[list[OmniJob], bool]:
        """Batched serving: move every job in ``jobs`` on by one step where it can; returns the jobs that
        finished (answered, their resources released) and whether anything moved. A job failing alone is
        answered with :meth:`fail` and returned as finished; an exception fails the whole batch."""
        raise NotImplementedError(f"{type(self).__name__} does not serve batched")

    def release(self, job: OmniJob) -> None:
        """Batched serving: free what ``job`` holds (its cache slot); it will not be advanced again."""

    @contextlib.contextmanager
    def alone(self, job: OmniJob, finished: list[OmniJob]) -> Iterator[None]:
        """Inside :meth:`advance`, work of ``job`` alone (its input, its prefill): a cancellation or a failure
        there ends this request, not the batch: it is released, a failure answered with :meth:`fail`, and
        ``job`` added to ``finished``."""
        try:
            yield
        except CancelledRequestError:
            self.release(job)
            finished.append(job)
        except Exception as err:  # this request's input or prefill failed, not the batch
            self.fail(job, err)
            self.release(job)
            finished.append(job)

    # ------------------------------------------------------------ the worker

    def worker_mode(self) -> contextlib.AbstractContextManager[Any]:
        if self._stream is None:
            self._stream = new_stream(self.device, priority=self._stream_priority)
        stack = contextlib.ExitStack()
        stack.enter_context(torch.inference_mode())
        stack.enter_context(on_stream(self._stream))
        return stack

    def load(self) -> None:
        with self.worker_mode():
            self.load_part()
        log.info(
            "Loaded %s on %s for stage %s (%s)",
            type(self).__name__,
            self.device,
            self.stage.name,
            "batched" if self.batched else "one request at a time",
        )

    def submit(self, job: OmniJob) -> None:
        job.submitted = time.monotonic()
        super().submit(job)
        self._wake.set()

    def work(self) -> EngineWork:
        return self.clock.read()

    def wait_idle(self, timeout: float) -> None:
        """Inside a step, wait up to ``timeout`` for an upstream frame or a job, not counted as busy."""
        with self.clock.idle():
            self._wake.wait(timeout)

    def serve(self) -> None:
        if self.batched:
            self._serve_batched()
            return
        while (job := self.take()) is not None:
            if job.cancelled:
                continue
            self._current = job
            self.clock.admitted(job)
            try:
                with self.clock.working():
                    self.run(job)
            except CancelledRequestError:
                pass
            except Exception as err:  # a failed request fails itself, not the engine
                self.fail(job, err)
                self.flush()
            finally:
                self._current = None

    def _serve_batched(self) -> None:
        active = self._active
        while True:
            self.flush()
            if self.stopping:
                for job in active:
                    self.refuse(job)
                    self.release(job)
                active.clear()
                return
            # Idle: wait for a request; running: take whatever has arrived, without waiting.
            new: list[OmniJob] = []
            first = self.take() if not active else None
            if first is not None:
                new.append(first)
            while (more := self.take(0)) is not None:
                new.append(more)
            for job in new:
                self.clock.admitted(job)
            active.extend(job for job in new if not job.cancelled)
            alive = []
            for job in active:
                try:
                    self.check(job)
                    alive.append(job)
                except CancelledRequestError:
                    self.release(job)
                except StageError as err:
                    self.fail(job, err)
                    self.release(job)
            active[:] = alive
            if not active:
                continue
            self._wake.clear()
            try:
                with self.clock.working():
                    finished, moved = self.advance(active)
            except Exception as err:  # a failed batched step fails its batch, not the engine
                for job in active:
                    self.fail(job, err)
                    self.release(job)
                active.clear()
                continue
            gone = {id(job) for job in finished}
            active[:] = [job for job in active if id(job) not in gone]
            if not moved:
                self.flush()
                # Everyone waits for upstream input: sleep until a frame or a job arrives (or a moment
                # passes, so that cancellations and deadlines are still seen).
                self._wake.wait(0.05)

    @property
    def busy(self) -> bool:
        """Whether the worker is running a request right now."""
        return self._current is not None or bool(self._active)

    # ------------------------------------------------------------ event loop

    async def warm_up_on(self, frames: Sequence[ResponseFrame], params: StageParams) -> None:
        """Warm up on one request whose upstream stage sends ``frames`` and stops (the stages behind the
        thinker have no prompt of their own: a few made-up frames take their whole path once)."""

        async def upstream() -> AsyncIterator[ResponseFrame]:
            for frame in frames:
                yield frame
            yield FinalFrame("stop")

        request = StageRequest(request_id=f"warmup-{secrets.token_hex(4)}", prompt="", params=params)
        async for _ in self.generate(StageInput(request=request, upstream=upstream())):
            pass

    async def generate(self, inp: StageInput) -> AsyncIterator[ResponseFrame]:
        self.require_running()
        answer = self.query(inp.request)
        if answer is not None:
            for frame in answer:
                yield frame
            return
        job = OmniJob(request=inp.request, engine=self)
        await self.admit(inp, job)
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
                job.engine._wake.set()
        except asyncio.CancelledError:
            raise
        except Exception as err:  # the worker raises it where it waits for input
            job.feed.put(err)
        finally:
            job.feed.put(_END)
            job.engine._wake.set()
