"""A stage whose engine runs in this process (``omnimodel serve``): frames pass as Python objects."""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from omnimodel_runtime.engines.base import Engine
from omnimodel_runtime.errors import StageUnavailableError
from omnimodel_runtime.metrics import StageMetrics, instrumented
from omnimodel_runtime.pipeline import Stage
from omnimodel_runtime.protocol.stage import ResponseFrame, StageInput, StageVoices
from omnimodel_runtime.stage.handle import StageHandle
from omnimodel_runtime.stage.info import engine_voices

log = logging.getLogger(__name__)

# Per event loop: an asyncio.Lock belongs to the loop it first waits on (tests run many loops).
_LOAD_LOCKS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = weakref.WeakKeyDictionary()


def _load_lock() -> asyncio.Lock:
    return _LOAD_LOCKS.setdefault(asyncio.get_running_loop(), asyncio.Lock())


class LocalStage(StageHandle):
    """An engine in this process (``omnimodel serve``): frames pass as Python objects, no copies.

    ``engine`` is a ready-made engine or a coroutine function creating one at start-up (resolving
    the model may build a tiny model or download weights, which must not delay the server's start).
    """

    def __init__(self, stage: Stage, engine: Engine | Callable[[], Awaitable[Engine]], metrics: StageMetrics) -> None:
        super().__init__(stage)
        self._factory = None if isinstance(engine, Engine) else engine
        self.engine: Engine | None = engine if isinstance(engine, Engine) else None
        self.metrics = metrics
        self._ready = False
        self._started = False

    async def start(self) -> None:
        began = time.monotonic()
        if self.engine is None:
            assert self._factory is not None
            log.info("Stage %s: resolving the model (a tiny:// one is built on first use)", self.name)
            self.engine = await self._factory()
        self.metrics.track_queue_depth(self.engine.queue_depth)
        self.metrics.track_work(self.engine.work)
        self._started = True
        # One engine loads at a time in a process: transformers' and diffusers' lazy imports and
        # from_pretrained are not safe to run from several threads at once (seen: corrupted modules).
        async with _load_lock():
            log.info("Stage %s: loading the %s engine", self.name, self.stage.engine.value)
            await self.engine.start()
        log.info("Stage %s: warming up", self.name)
        await self.engine.warmup()
        self._ready = True
        log.info("Stage %s is ready (%.1f s)", self.name, time.monotonic() - began)

    async def stop(self) -> None:
        self._ready = False
        if self.engine is not None and self._started:
            self._started = False
            await self.engine.stop()

    @property
    def ready(self) -> bool:
        return self._ready

    def describe(self) -> dict[str, Any]:
        return {"ready": self._ready, "mode": "local", "engine": self.stage.engine.value}

    def generate(self, inp: StageInput) -> AsyncIterator[ResponseFrame]:
        if not self._ready or self.engine is None:
            raise StageUnavailableError(f"stage {self.name!r} is not ready yet")
        return instrumented(self.engine.generate(inp), self.metrics)

    async def voices(self) -> StageVoices | None:
        if not self._ready or self.engine is None:
            raise StageUnavailableError(f"stage {self.name!r} is not ready yet")
        return await engine_voices(self.engine)

    @property
    def max_model_len(self) -> int | None:
        return self.engine.max_model_len if self.engine is not None else None
