"""Walks the stage graph for one request: which stages it needs, and the frames that come back."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any

from omnimodel_runtime.engines.base import StageInput
from omnimodel_runtime.pipeline import Modality, Pipeline, Stage
from omnimodel_runtime.protocol.stage import ResponseFrame, StageRequest
from omnimodel_runtime.serving.errors import APIError
from omnimodel_runtime.stage.handle import StageHandle


class Orchestrator:
    """Routes requests through the stages of ``pipeline`` reachable via ``handles`` (local or remote).

    A request asks only for the stages its output modalities need (``Pipeline.stages_for``): text chat
    on an omni pipeline touches the thinker and never the talker or the vocoder.
    """

    def __init__(self, pipeline: Pipeline, handles: Mapping[str, StageHandle]) -> None:
        missing = [s.name for s in pipeline.stages if s.name not in handles]
        if missing:
            raise ValueError(f"no handle for stage(s) {', '.join(missing)}")
        self.pipeline = pipeline
        self.handles = dict(handles)

    @property
    def ready(self) -> bool:
        return all(h.ready for h in self.handles.values())

    def describe(self) -> dict[str, Any]:
        return {name: h.describe() for name, h in self.handles.items()}

    def plan(self, modalities: Iterable[Modality]) -> list[Stage]:
        """The stages a request for ``modalities`` visits, in graph order."""
        wanted = list(modalities)
        unserved = [m.value for m in wanted if m not in self.pipeline.modalities]
        if unserved:
            served = ", ".join(m.value for m in self.pipeline.modalities)
            raise APIError(
                f"model {self.pipeline.model.name!r} cannot output {', '.join(unserved)} (it outputs {served})",
                param="modalities",
            )
        return self.pipeline.stages_for(wanted)

    def generate(self, request: StageRequest, modalities: Iterable[Modality]) -> AsyncIterator[ResponseFrame]:
        """Stream the frames that answer ``request``."""
        stages = self.plan(modalities)
        if len(stages) != 1:
            # Multi-stage hand-off (thinker -> talker -> code2wav, encode -> denoise -> decode) arrives
            # with the presets that need it; the frame protocol already carries streamed inputs.
            names = " -> ".join(s.name for s in stages)
            raise APIError(
                f"this gateway cannot run requests that span several stages yet ({names})",
                status=501,
                type="not_implemented",
            )
        return self.handles[stages[0].name].generate(StageInput(request=request))
