"""How the orchestrator sees one stage of the graph, wherever it runs: :class:`StageHandle`.

Two kinds exist: :class:`~omnimodel_runtime.stage.local.LocalStage` (the engine in this process,
``omnimodel serve``) and :class:`~omnimodel_runtime.stage.remote.RemoteStage` (stage servers reached over
the frame protocol, ``omnimodel gateway``). Both give the same thing: ``generate(StageInput)`` streaming
response frames, with failures raised as :class:`~omnimodel_runtime.errors.StageError` (never returned as
error frames), and ``ready`` for the gateway's ``/health``.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from typing import Any

from omnimodel_runtime.pipeline import Stage
from omnimodel_runtime.protocol.stage import ResponseFrame, StageInput, StageVoices


class StageHandle(abc.ABC):
    """One stage of the graph as the orchestrator sees it."""

    def __init__(self, stage: Stage) -> None:
        self.stage = stage

    @property
    def name(self) -> str:
        return self.stage.name

    @abc.abstractmethod
    async def start(self) -> None:
        """Become able to serve (load the engine / reach the endpoints)."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Release resources."""

    @property
    @abc.abstractmethod
    def ready(self) -> bool:
        """Whether a request sent now can be served."""

    @abc.abstractmethod
    def describe(self) -> dict[str, Any]:
        """Health details for ``/health``."""

    @abc.abstractmethod
    def generate(self, inp: StageInput) -> AsyncIterator[ResponseFrame]:
        """Run one request on the stage; raises ``StageError`` on failure."""

    @abc.abstractmethod
    async def voices(self) -> StageVoices | None:
        """The voices of the stage that reads a speech request's text, as its ``/v1/stage/info`` lists
        them (None: its model ships none); raises ``StageError`` when the stage cannot be reached."""

    @property
    def max_model_len(self) -> int | None:
        """Longest prompt + completion the stage's engine accepts, when this gateway knows it."""
        return None
