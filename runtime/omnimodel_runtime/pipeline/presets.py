"""The preset catalogue: named stage graphs with default engines, accelerators and API routes.

A preset is a template; :meth:`Preset.pipeline` binds it to a model and applies per-stage overrides
(the operator passes what the OmniModel's ``spec.stages`` says, ``omnimodel serve`` what its flags say).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from pydantic import BaseModel, ConfigDict

from omnimodel_runtime.pipeline.files import StageFiles
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
OVERRIDABLE_FIELDS: Final = frozenset({"engine", "accelerator", "engine_args", "endpoints", "files"})


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

# ---------------------------------------------------------------- the files each preset's stages read
# (patterns as in omnimodel_runtime.pipeline.files: ``*`` stays within one folder, ``**`` crosses them).

# A plain LLM reads its whole repository.
TEXT_FILES: Final = StageFiles(patterns=("**",))

# Diffusers layout: every stage reads the pipeline index and the VAE and transformer configs (the split
# pipeline's defaults and VAE factors come from them); each loads only its own components' folders
# (``text_encoder_2``/``tokenizer_2`` of two-encoder families included).
_T2I_SHARED: Final = ("model_index.json", "transformer/config.json", "vae/config.json")
T2I_FILES: Final[Mapping[str, StageFiles]] = {
    "encode": StageFiles(patterns=(*_T2I_SHARED, "text_encoder*/**", "tokenizer*/**")),
    "denoise": StageFiles(patterns=(*_T2I_SHARED, "transformer/**", "scheduler/**")),
    "decode": StageFiles(patterns=(*_T2I_SHARED, "vae/**")),
}

# Qwen-Image-Edit (diffusers QwenImageEditPipeline): encode also runs the processor that shows the text
# encoder the input image, and the VAE that encodes it.
EDIT_FILES: Final[Mapping[str, StageFiles]] = {
    **T2I_FILES,
    "encode": StageFiles(patterns=(*_T2I_SHARED, "text_encoder*/**", "tokenizer*/**", "processor/**", "vae/**")),
}

# Wan2.2 text-to-video (diffusers WanPipeline) in one stage: the whole pipeline, both transformer experts
# (``transformer_2`` is absent from a Wan2.1 checkpoint; the pattern then matches nothing).
T2V_FILES: Final = StageFiles(
    patterns=(
        "model_index.json",
        "text_encoder/**",
        "tokenizer/**",
        "transformer/**",
        "transformer_2/**",
        "vae/**",
        "scheduler/**",
    )
)

# Our TTS layout (omnimodel_runtime.layout): acoustic/ and vocoder/ hold each stage's model, voices/ and
# speech.json the acoustic stage's voices and stopping rule. The acoustic stage also takes the top-level
# files: a plain SpeechT5 snapshot, which keeps its model there, serves as the acoustic stage as it is.
TTS_FILES: Final[Mapping[str, StageFiles]] = {
    "acoustic": StageFiles(patterns=("*", "acoustic/**", "voices/**")),
    "vocoder": StageFiles(patterns=("vocoder/**",)),
}

# Qwen2.5-Omni: one checkpoint whose thinker.*, talker.* and token2wav.* tensors are the three stages'
# weights; every stage also reads the top-level configuration, tokenizer, processor and speaker files.
_OMNI_SHARED: Final = ("*.json", "*.jinja", "*.txt", "spk_dict.pt")
OMNI_FILES: Final[Mapping[str, StageFiles]] = {
    "thinker": StageFiles(patterns=_OMNI_SHARED, tensor_prefixes=("thinker.",)),
    "talker": StageFiles(patterns=_OMNI_SHARED, tensor_prefixes=("talker.",)),
    "code2wav": StageFiles(patterns=_OMNI_SHARED, tensor_prefixes=("token2wav.",)),
}

# Qwen3-Omni: the same layout (thinker.*, talker.* — code predictor included — and code2wav.* tensors); its
# voices are in config.json, so there is no speaker file.
QWEN3_OMNI_FILES: Final[Mapping[str, StageFiles]] = {
    "thinker": StageFiles(patterns=_OMNI_SHARED, tensor_prefixes=("thinker.",)),
    "talker": StageFiles(patterns=_OMNI_SHARED, tensor_prefixes=("talker.",)),
    "code2wav": StageFiles(patterns=_OMNI_SHARED, tensor_prefixes=("code2wav.",)),
}


def _omni_stages(family: str, files: Mapping[str, StageFiles]) -> tuple[Stage, ...]:
    """The thinker -> talker -> code2wav graph of an omni family (tasks ``<family>-<stage>``)."""
    return (
        Stage(
            name="thinker",
            kind=StageKind.AR,
            engine=EngineName.TRANSFORMERS,
            task=f"{family}-thinker",
            outputs=(Modality.TEXT,),
            accelerator=_gpu(),
            files=files["thinker"],
        ),
        Stage(
            name="talker",
            kind=StageKind.GENERATION,
            engine=EngineName.TRANSFORMERS,
            task=f"{family}-talker",
            inputs=("thinker",),
            accelerator=_gpu(),
            files=files["talker"],
        ),
        Stage(
            name="code2wav",
            kind=StageKind.VOCODER,
            engine=EngineName.TRANSFORMERS,
            task=f"{family}-code2wav",
            inputs=("talker",),
            outputs=(Modality.AUDIO,),
            accelerator=_gpu(),
            files=files["code2wav"],
        ),
    )


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
                    files=TEXT_FILES,
                ),
            ),
            modalities=(Modality.TEXT,),
            routes=(Route.CHAT, Route.COMPLETIONS),
        ),
        Preset(
            name="qwen2.5-omni",
            description="Qwen2.5-Omni: thinker (text) -> talker (codec codes) -> code2wav (24 kHz audio).",
            stages=_omni_stages("omni", OMNI_FILES),
            modalities=(Modality.TEXT, Modality.AUDIO),
            routes=(Route.CHAT, Route.SPEECH),
        ),
        Preset(
            name="qwen3-omni",
            description=(
                "Qwen3-Omni: MoE thinker (text) -> talker with code predictor (multi-codebook codes) -> "
                "code2wav (24 kHz audio)."
            ),
            stages=_omni_stages("qwen3-omni", QWEN3_OMNI_FILES),
            modalities=(Modality.TEXT, Modality.AUDIO),
            routes=(Route.CHAT,),
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
                    files=T2I_FILES["encode"],
                ),
                Stage(
                    name="denoise",
                    kind=StageKind.DIFFUSION,
                    engine=EngineName.DIFFUSERS,
                    task="t2i-denoise",
                    inputs=("encode",),
                    accelerator=_gpu(),
                    files=T2I_FILES["denoise"],
                ),
                Stage(
                    name="decode",
                    kind=StageKind.DECODER,
                    engine=EngineName.DIFFUSERS,
                    task="t2i-decode",
                    inputs=("denoise",),
                    outputs=(Modality.IMAGE,),
                    accelerator=_gpu(),
                    files=T2I_FILES["decode"],
                ),
            ),
            modalities=(Modality.IMAGE,),
            routes=(Route.IMAGES, Route.CHAT),
        ),
        Preset(
            name="qwen-image-edit",
            description="Image edits (Qwen-Image-Edit): encode (prompt + image) -> denoise (DiT) -> decode (VAE).",
            stages=tuple(
                Stage(
                    name=name,
                    kind=kind,
                    engine=EngineName.DIFFUSERS,
                    task=f"image-edit-{name}",
                    inputs=inputs,
                    outputs=(Modality.IMAGE,) if name == "decode" else (),
                    accelerator=_gpu(),
                    files=EDIT_FILES[name],
                )
                for name, kind, inputs in (
                    ("encode", StageKind.ENCODER, ()),
                    ("denoise", StageKind.DIFFUSION, ("encode",)),
                    ("decode", StageKind.DECODER, ("denoise",)),
                )
            ),
            modalities=(Modality.IMAGE,),
            # Chat too: vLLM-Omni's image-edit client sends the image as an image_url part.
            routes=(Route.IMAGE_EDITS, Route.CHAT),
        ),
        Preset(
            name="text-to-video",
            description="Text-to-video (Wan2.2 through diffusers' WanPipeline): the whole pipeline in one stage.",
            stages=(
                Stage(
                    name="generate",
                    kind=StageKind.DIFFUSION,
                    engine=EngineName.DIFFUSERS,
                    task="text-to-video",
                    outputs=(Modality.VIDEO,),
                    accelerator=_gpu(),
                    files=T2V_FILES,
                ),
            ),
            modalities=(Modality.VIDEO,),
            routes=(Route.VIDEOS,),
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
                    files=TTS_FILES["acoustic"],
                ),
                Stage(
                    name="vocoder",
                    kind=StageKind.VOCODER,
                    engine=EngineName.TRANSFORMERS,
                    task="tts-vocoder",
                    inputs=("acoustic",),
                    outputs=(Modality.AUDIO,),
                    accelerator=_CPU,
                    files=TTS_FILES["vocoder"],
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
