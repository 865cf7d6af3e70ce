"""A process's slow start (loading an engine, reaching stages), run in the background."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from omnimodel_runtime.errors import RuntimeSetupError

log = logging.getLogger(__name__)


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    if len(text) > 500:
        text = text[:500] + "…"
    return text if isinstance(err, RuntimeSetupError) else f"{type(err).__name__}: {text}"


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
            began = time.monotonic()
            try:
                await start()
            except asyncio.CancelledError:
                raise
            except Exception as err:
                self.phase, self.error = Phase.FAILED, _one_line(err)
                # One line for the operator of the process; the traceback is for --log-level debug (an
                # expected setup error, a missing extra or a bad model source, has none worth reading).
                log.error("Start-up failed after %.1f s: %s", time.monotonic() - began, self.error)
                if not isinstance(err, RuntimeSetupError):
                    log.debug("Start-up failure traceback", exc_info=err)
                self.failed.set()
            else:
                if self.phase is Phase.STARTING:
                    self.phase = Phase.READY
                    log.info("Start-up finished in %.1f s", time.monotonic() - began)
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
