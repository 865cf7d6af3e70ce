"""The preset catalogue: named stage graphs with default engines, accelerators and API routes.

A preset is a template; :meth:`Preset.pipeline` binds it to a model and applies per-stage overrides
(the operator passes what the OmniModel's ``spec.stages`` says, ``omnimodel serve`` what its flags say).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from pydantic import BaseModel, ConfigDict

from omnimodel_runtime.pipeline.graph import (
    AcceleratorRequest,
    EngineName,
    Modality,
    ModelSource,
    Pipeline,
    PipelineError,
    Route,
    Stage,
    StageKind,
    Vendor,
)

# Fields of a preset stage that an override may replace. ``inputs``/``kind``/``task``/``outputs``
# define the graph itself, which the runtime's orchestration depends on, so presets keep them.
OVERRIDABLE_FIELDS: Final = frozenset({"engine", "accelerator", "engine_args", "endpoints"})


class Preset(BaseModel):
    """A named stage-graph template."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    description: str
    stages: tuple[Stage, ...]
    modalities: tuple[Modality, ...]
    routes: tuple[Route, ...]

    @property
    def stage_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.stages)

    def pipeline(
        self,
        model: ModelSource,
        *,
        name: str | None = None,
        overrides: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> Pipeline:
        """Bind the preset to ``model``; ``overrides`` maps stage name → fields to replace."""
        overrides = dict(overrides or {})
        problems: list[tuple[str, str]] = []
        for stage_name, fields in overrides.items():
            if stage_name not in self.stage_names:
                problems.append(
                    (
                        f"stages[{stage_name}]",
                        f"preset {self.name!r} has no stage {stage_name!r} (it has {', '.join(self.stage_names)})",
                    )
                )
            for key in fields:
                if key not in OVERRIDABLE_FIELDS:
                    problems.append(
                        (
                            f"stages[{stage_name}].{key}",
                            f"cannot override {key!r} of preset {self.name!r}; a preset fixes its graph",
                        )
                    )
        if problems:
            raise PipelineError(problems)
        stages = []
        for stage in self.stages:
            fields = overrides.get(stage.name, {})
            data = stage.model_dump()
            data.update(fields)
            stages.append(Stage.model_validate(data))
        return Pipeline(
            name=name or self.name,
            preset=self.name,
            model=model,
            stages=tuple(stages),
            modalities=self.modalities,
            routes=self.routes,
        )


def _gpu(count: int = 1) -> AcceleratorRequest:
    return AcceleratorRequest(vendor=Vendor.NVIDIA, count=count)


_CPU: Final = AcceleratorRequest()

PRESETS: Final[Mapping[str, Preset]] = {
    p.name: p
    for p in (
        Preset(
            name="text",
            description="A plain LLM: one autoregressive stage.",
            stages=(
                Stage(
                    name="llm",
                    kind=StageKind.AR,
                    engine=EngineName.VLLM,
                    task="text-generation",
                    outputs=(Modality.TEXT,),
                    accelerator=_gpu(),
                ),
            ),
            modalities=(Modality.TEXT,),
            routes=(Route.CHAT, Route.COMPLETIONS),
        ),
        Preset(
            name="qwen2.5-omni",
            description="Qwen2.5-Omni: thinker (text) -> talker (codec codes) -> code2wav (24 kHz audio).",
            stages=(
                Stage(
                    name="thinker",
                    kind=StageKind.AR,
                    engine=EngineName.TRANSFORMERS,
                    task="omni-thinker",
                    outputs=(Modality.TEXT,),
                    accelerator=_gpu(),
                ),
                Stage(
                    name="talker",
                    kind=StageKind.GENERATION,
                    engine=EngineName.TRANSFORMERS,
                    task="omni-talker",
                    inputs=("thinker",),
                    accelerator=_gpu(),
                ),
                Stage(
                    name="code2wav",
                    kind=StageKind.VOCODER,
                    engine=EngineName.TRANSFORMERS,
                    task="omni-code2wav",
                    inputs=("talker",),
                    outputs=(Modality.AUDIO,),
                    accelerator=_gpu(),
                ),
            ),
            modalities=(Modality.TEXT, Modality.AUDIO),
            routes=(Route.CHAT, Route.SPEECH),
        ),
        Preset(
            name="text-to-image",
            description="Text-to-image diffusion: encode (text encoder) -> denoise (DiT) -> decode (VAE).",
            stages=(
                Stage(
                    name="encode",
                    kind=StageKind.ENCODER,
                    engine=EngineName.DIFFUSERS,
                    task="t2i-encode",
                    accelerator=_gpu(),
                ),
                Stage(
                    name="denoise",
                    kind=StageKind.DIFFUSION,
                    engine=EngineName.DIFFUSERS,
                    task="t2i-denoise",
                    inputs=("encode",),
                    accelerator=_gpu(),
                ),
                Stage(
                    name="decode",
                    kind=StageKind.DECODER,
                    engine=EngineName.DIFFUSERS,
                    task="t2i-decode",
                    inputs=("denoise",),
                    outputs=(Modality.IMAGE,),
                    accelerator=_gpu(),
                ),
            ),
            modalities=(Modality.IMAGE,),
            routes=(Route.IMAGES, Route.CHAT),
        ),
        Preset(
            name="tts",
            description="Two-stage text-to-speech: acoustic model (text -> mel) -> vocoder (mel -> waveform).",
            stages=(
                Stage(
                    name="acoustic",
                    kind=StageKind.GENERATION,
                    engine=EngineName.TRANSFORMERS,
                    task="tts-acoustic",
                    accelerator=_gpu(),
                ),
                Stage(
                    name="vocoder",
                    kind=StageKind.VOCODER,
                    engine=EngineName.TRANSFORMERS,
                    task="tts-vocoder",
                    inputs=("acoustic",),
                    outputs=(Modality.AUDIO,),
                    accelerator=_CPU,
                ),
            ),
            modalities=(Modality.AUDIO,),
            routes=(Route.SPEECH,),
        ),
    )
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise PipelineError([("preset", f"unknown preset {name!r} (known: {', '.join(PRESETS)})")]) from None
