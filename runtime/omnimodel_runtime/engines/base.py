"""The one interface every engine adapter implements, and what it is given."""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from omnimodel_runtime.pipeline import Stage
from omnimodel_runtime.protocol.stage import ResponseFrame, StageInput
from omnimodel_runtime.settings import RuntimeSettings


class EngineMetrics(Protocol):
    """Hooks an engine calls; the stage server backs them with Prometheus metrics."""

    def observe_batch(self, size: int) -> None:
        """A forward pass ran over ``size`` requests at once."""

    def add_generated_tokens(self, count: int) -> None:
        """``count`` output tokens were produced."""


@dataclass(frozen=True)
class EngineWork:
    """What an engine's worker has done since it started, read at each metrics scrape: the load figures that
    name a saturated stage (``omnimodel_engine_*`` counters; rates over an interval give its busy fraction
    and mean queue wait)."""

    busy_seconds: float  # inside model calls, not waiting for requests or for upstream input
    admitted: int  # requests the worker has taken from its queue
    queue_wait_seconds: float  # their time from submission to the worker taking them, summed


class NullMetrics:
    """Metrics hooks that record nothing (direct engine use, benchmarks' baseline)."""

    def observe_batch(self, size: int) -> None:
        pass

    def add_generated_tokens(self, count: int) -> None:
        pass


def flag(args: Mapping[str, Any], name: str, *, default: bool) -> bool:
    """A boolean engine argument (``true``/``false``, also as strings from the command line; an empty
    value is off)."""
    value = args.get(name)
    if value is None:
        return default
    return str(value).lower() not in ("0", "false", "no", "off", "")


@dataclass(frozen=True)
class EngineContext:
    """Everything an adapter is constructed with."""

    stage: Stage
    model_dir: Path
    settings: RuntimeSettings
    metrics: EngineMetrics = field(default_factory=NullMetrics)


class Engine(abc.ABC):
    """An inference engine serving one stage.

    Life cycle: :meth:`start` (load weights), :meth:`warmup` (run once so the first real request does
    not pay for lazy initialisation), then any number of concurrent :meth:`generate` calls, then
    :meth:`stop`. ``generate`` is an async iterator of frames ending with a ``FinalFrame``; closing it
    early (the caller went away) or cancelling the task iterating it must abort the request inside the
    engine. Bad input raises :class:`~omnimodel_runtime.errors.StageError` with a 4xx status.
    """

    def __init__(self, context: EngineContext) -> None:
        self.context = context

    @property
    def stage(self) -> Stage:
        return self.context.stage

    @abc.abstractmethod
    async def start(self) -> None:
        """Load the model; must not block the event loop."""

    async def warmup(self) -> None:  # noqa: B027 - engines without lazy initialisation need nothing
        """Exercise the engine once before reporting healthy."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Release the model and any worker threads or processes."""

    @abc.abstractmethod
    def generate(self, inp: StageInput) -> AsyncIterator[ResponseFrame]:
        """Run one request, streaming frames."""

    def queue_depth(self) -> int:
        """Requests accepted but not yet started (the autoscaling signal)."""
        return 0

    def work(self) -> EngineWork | None:
        """The worker's load figures so far; ``None`` where the engine does not measure them."""
        return None

    @property
    def max_model_len(self) -> int | None:
        """Longest prompt + completion the engine accepts, when it has such a limit."""
        return None
