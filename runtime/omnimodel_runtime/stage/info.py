"""What a stage reports about itself, asked of its engine in this process: :class:`StageInfo`, the body of
the stage server's ``GET /v1/stage/info``, and the voices :class:`~omnimodel_runtime.stage.local.LocalStage`
gives in process."""

from __future__ import annotations

import secrets

from omnimodel_runtime.engines.base import Engine
from omnimodel_runtime.pipeline import Modality, Pipeline, Stage
from omnimodel_runtime.protocol.stage import (
    QUERY_VOICES,
    FinalFrame,
    StageInfo,
    StageInput,
    StageParams,
    StageRequest,
    StageVoices,
    TensorFrame,
)


def reads_speech(pipeline: Pipeline, stage: Stage) -> bool:
    """Whether ``stage`` reads the text of a speech request (the entry of the audio chain): the stage
    whose engine knows the voices."""
    return Modality.AUDIO in pipeline.modalities and pipeline.stages_for([Modality.AUDIO])[0].name == stage.name


async def engine_voices(engine: Engine) -> StageVoices | None:
    """The voices a speech engine ships, asked of the engine in process (its ``QUERY_VOICES`` answer,
    given at once, never queued behind generations); None when its model has none."""
    request = StageRequest(request_id=f"voices-{secrets.token_hex(8)}", params=StageParams(query=QUERY_VOICES))
    frames = engine.generate(StageInput(request=request))
    try:
        async for frame in frames:
            if isinstance(frame, TensorFrame) and "voices" in frame.meta:
                names = tuple(str(v) for v in frame.meta["voices"])
                return StageVoices(names=names, default=str(frame.meta.get("default", "default")))
            if isinstance(frame, FinalFrame):
                break
    finally:
        # The engine's generator, closed now rather than at garbage collection.
        close = getattr(frames, "aclose", None)
        if close is not None:
            await close()
    return None


async def stage_info(
    pipeline: Pipeline, stage: Stage, engine: Engine | None, *, status: str, error: str | None = None
) -> StageInfo:
    """``stage``'s info; what only a ready engine knows (its limits, its voices) when ``status`` is ready."""
    ready = engine if status == "ready" else None
    return StageInfo(
        stage=stage.name,
        engine=stage.engine.value,
        task=stage.task,
        model=pipeline.model.name,
        status=status,
        error=error,
        max_model_len=ready.max_model_len if ready is not None else None,
        voices=await engine_voices(ready) if ready is not None and reads_speech(pipeline, stage) else None,
    )
