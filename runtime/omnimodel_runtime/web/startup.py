"""A process's slow start (loading an engine, reaching stages), run in the background."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from omnimodel_runtime.errors import RuntimeSetupError

log = logging.getLogger(__name__)


class Phase(enum.StrEnum):
    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"
    STOPPING = "stopping"


class Startup:
    """Runs a slow start (loading an engine, reaching stages) in the background so the server answers
    ``/livez`` and a 503 ``/health`` meanwhile; ``failed`` lets the process runner exit on failure."""

    def __init__(self) -> None:
        self.phase = Phase.STARTING
        self.error: str | None = None
        self.failed = asyncio.Event()
        self.settled = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def begin(self, start: Callable[[], Awaitable[None]]) -> None:
        async def run() -> None:
            try:
                await start()
            except asyncio.CancelledError:
                raise
            except Exception as err:
                log.exception("Start-up failed")
                self.phase, self.error = Phase.FAILED, f"{type(err).__name__}: {err}"
                self.failed.set()
            else:
                if self.phase is Phase.STARTING:
                    self.phase = Phase.READY
            finally:
                self.settled.set()

        self._task = asyncio.create_task(run())

    async def cancel(self) -> None:
        self.phase = Phase.STOPPING
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def wait(self) -> None:
        """Until start-up finished; raises ``RuntimeSetupError`` when it failed."""
        await self.settled.wait()
        if self.phase is Phase.FAILED:
            raise RuntimeSetupError(self.error or "start-up failed")

    @property
    def ready(self) -> bool:
        return self.phase is Phase.READY

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"status": self.phase.value}
        if self.error:
            out["error"] = self.error
        return out

    def lifespan(
        self, start: Callable[[], Awaitable[None]], stop: Callable[[], Awaitable[None]]
    ) -> Callable[[Any], AbstractAsyncContextManager[None]]:
        """An app's lifespan around this start-up: ``start`` runs in the background once the server is
        up (it answers ``/livez`` meanwhile); at shutdown, after the server has drained in-flight
        requests, an unfinished start is cancelled and ``stop`` releases what was started."""

        @asynccontextmanager
        async def lifespan(_: Any) -> AsyncIterator[None]:
            self.begin(start)
            try:
                yield
            finally:
                await self.cancel()
                await stop()

        return lifespan
