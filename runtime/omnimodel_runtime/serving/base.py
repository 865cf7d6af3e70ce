"""What every OpenAI-facing service shares (chat, completions, chat with audio, speech, images)."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from omnimodel_runtime.pipeline import Stage
from omnimodel_runtime.protocol.stage import ResponseFrame
from omnimodel_runtime.serving.errors import APIError
from omnimodel_runtime.serving.orchestrator import Orchestrator
from omnimodel_runtime.web.access import current_request_id, new_request_id


class Service:
    """Translates one family of OpenAI requests into stage requests sent through ``orchestrator``."""

    def __init__(self, orchestrator: Orchestrator, *, request_timeout: float) -> None:
        self.orchestrator = orchestrator
        self.model_name = orchestrator.pipeline.model.name
        # The whole request's budget; stages abandon it at the deadline it becomes.
        self.request_timeout = request_timeout

    def check_model(self, model: str | None) -> None:
        """A 404 naming the model this server serves when a request names another one."""
        if model is not None and model != self.model_name:
            raise APIError(
                f"The model `{model}` does not exist (this server serves `{self.model_name}`).",
                status=404,
                param="model",
                code="model_not_found",
            )

    @staticmethod
    def request_id() -> str:
        """The id of the HTTP request being served (its access log line, its ``X-Request-ID``), which
        names its stage requests too; a fresh one outside of an HTTP request."""
        return current_request_id() or new_request_id()

    def deadline(self) -> float:
        """The absolute time (Unix seconds) a stage request made now must be done by."""
        return time.time() + self.request_timeout


async def aclose(stream: AsyncIterator[Any]) -> None:
    """Close a frame stream now rather than at garbage collection: that cancels the stages behind it."""
    close = getattr(stream, "aclose", None)
    if close is not None:
        await close()


async def frames_of(chain: AsyncIterator[tuple[Stage, ResponseFrame]]) -> AsyncGenerator[ResponseFrame, None]:
    """The frames of a chain that answers from one stage (text, a video), without the stage; closing
    this closes the chain."""
    try:
        async for _, frame in chain:
            yield frame
    finally:
        await aclose(chain)
