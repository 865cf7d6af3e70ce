"""Stage-graph models and their validation.

A :class:`Pipeline` is what the operator writes into the ``<cr>-pipeline`` ConfigMap and what every
runtime process (stage server, gateway, all-in-one ``serve``) reads. It is fully resolved: presets
are already expanded, engines and accelerators chosen, stage endpoints filled in.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Final, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from omnimodel_runtime.pipeline.files import StageFiles

PIPELINE_FILE_VERSION: Final = "omnimodel.io/pipeline-v1"

# A stage name becomes part of Kubernetes object names (``<cr>-<stage>``) and DNS labels.
STAGE_NAME_PATTERN: Final = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
STAGE_NAME_MAX: Final = 40


class Modality(StrEnum):
    """What a pipeline hands back to the client."""

    TEXT = "text"
    AUDIO = "audio"
    IMAGE = "image"
    VIDEO = "video"


class InputModality(StrEnum):
    """What a chat request may hand a pipeline's entry stage beside text (content parts)."""

    TEXT = "text"
    AUDIO = "audio"
    IMAGE = "image"
    VIDEO = "video"


class StageKind(StrEnum):
    """The computational shape of a stage; informs batching and defaults, not routing."""

    AR = "ar"
    GENERATION = "generation"
    DIFFUSION = "diffusion"
    ENCODER = "encoder"
    DECODER = "decoder"
    VOCODER = "vocoder"


class EngineName(StrEnum):
    """Inference library that runs a stage."""

    VLLM = "vllm"
    TRANSFORMERS = "transformers"
    DIFFUSERS = "diffusers"


# The tasks each engine runs, for graphs described without a preset. The operator rejects any other
# (engine, task) pair before a pod starts; tests/unit/runtime checks this against the engine registry.
ENGINE_TASKS: Final[Mapping[EngineName, tuple[str, ...]]] = {
    EngineName.VLLM: ("text-generation",),
    EngineName.TRANSFORMERS: (
        "text-generation",
        "omni-thinker",
        "omni-talker",
        "omni-code2wav",
        "qwen3-omni-thinker",
        "qwen3-omni-talker",
        "qwen3-omni-code2wav",
        "tts-acoustic",
        "tts-vocoder",
    ),
    EngineName.DIFFUSERS: (
        "text-to-image",
        "t2i-encode",
        "t2i-denoise",
        "t2i-decode",
        "image-edit",
        "image-edit-encode",
        "image-edit-denoise",
        "image-edit-decode",
        "text-to-video",
    ),
}


# What the entry stage of each task takes from a chat beside text (content parts of user messages); a
# task not named here takes text only, and the gateway refuses any other part with a 400 naming it.
TASK_INPUTS: Final[Mapping[str, tuple[InputModality, ...]]] = {
    "omni-thinker": (InputModality.TEXT, InputModality.AUDIO, InputModality.IMAGE, InputModality.VIDEO),
    "qwen3-omni-thinker": (InputModality.TEXT, InputModality.AUDIO, InputModality.IMAGE, InputModality.VIDEO),
}


class Vendor(StrEnum):
    """Accelerator vendor; ``cpu`` means no device at all."""

    NVIDIA = "nvidia"
    AMD = "amd"
    INTEL = "intel"
    ASCEND = "ascend"
    CPU = "cpu"


class Route(StrEnum):
    """OpenAI API families a pipeline can serve; the gateway registers only these."""

    CHAT = "chat"
    COMPLETIONS = "completions"
    IMAGES = "images"
    # /v1/images/edits: only pipelines whose entry stage edits an input image.
    IMAGE_EDITS = "image-edits"
    SPEECH = "speech"
    # /v1/videos: OpenAI's (and vLLM-Omni's) asynchronous video jobs.
    VIDEOS = "videos"


# Which output modality a route needs somewhere in the graph (chat answers in any modality).
ROUTE_MODALITY: Final[Mapping[Route, Modality | None]] = {
    Route.CHAT: None,
    Route.COMPLETIONS: Modality.TEXT,
    Route.IMAGES: Modality.IMAGE,
    Route.IMAGE_EDITS: Modality.IMAGE,
    Route.SPEECH: Modality.AUDIO,
    Route.VIDEOS: Modality.VIDEO,
}


def default_routes(modalities: Iterable[Modality]) -> tuple[Route, ...]:
    """Routes a custom (preset-less) graph serves, derived from what it outputs."""
    mods = set(modalities)
    routes: list[Route] = [Route.CHAT] if mods & {Modality.TEXT, Modality.IMAGE} else []
    if Modality.TEXT in mods:
        routes.append(Route.COMPLETIONS)
    if Modality.IMAGE in mods:
        routes.append(Route.IMAGES)
    if Modality.AUDIO in mods:
        routes.append(Route.SPEECH)
    if Modality.VIDEO in mods:
        routes.append(Route.VIDEOS)
    return tuple(routes)


class PipelineError(ValueError):
    """A stage graph that cannot run; ``problems`` holds ``(path, message)`` pairs."""

    def __init__(self, problems: Iterable[tuple[str, str]]) -> None:
        self.problems: list[tuple[str, str]] = list(problems)
        super().__init__("; ".join(f"{path}: {msg}" for path, msg in self.problems))


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_enum_values=False)


class AcceleratorRequest(_Model):
    """Devices one replica of a stage needs."""

    vendor: Vendor = Vendor.CPU
    product: str | None = None
    count: Annotated[int, Field(ge=0, le=64)] = 0

    @model_validator(mode="after")
    def _count_matches_vendor(self) -> Self:
        if self.vendor is not Vendor.CPU and self.count < 1:
            raise ValueError(f"accelerator count must be >= 1 for vendor {self.vendor.value}")
        if self.vendor is Vendor.CPU and (self.count or self.product):
            raise ValueError("a cpu accelerator takes neither count nor product")
        return self


class ModelSource(_Model):
    """Where weights come from: ``hf://org/name``, ``pvc://claim/path``, ``file:///path``, ``tiny://preset``."""

    source: Annotated[str, Field(min_length=1, pattern=r"^(hf|pvc|file|tiny)://.+")]
    revision: str | None = None
    served_name: str | None = None

    @property
    def scheme(self) -> str:
        return self.source.split("://", 1)[0]

    @property
    def name(self) -> str:
        """The model id clients use in requests (``model`` field)."""
        if self.served_name:
            return self.served_name
        return self.source.split("://", 1)[1].rstrip("/")


class Stage(_Model):
    """One node of the graph: an engine doing one task, fed by ``inputs``."""

    name: Annotated[str, Field(pattern=STAGE_NAME_PATTERN, max_length=STAGE_NAME_MAX)]
    kind: StageKind
    engine: EngineName
    task: Annotated[str, Field(min_length=1)]
    inputs: tuple[str, ...] = ()
    outputs: tuple[Modality, ...] = ()
    accelerator: AcceleratorRequest = AcceleratorRequest()
    engine_args: Mapping[str, Any] = Field(default_factory=dict)
    endpoints: tuple[str, ...] = ()
    # The files of the model repository this stage reads (presets fill it in); None: all of them.
    files: StageFiles | None = None


class Pipeline(_Model):
    """A resolved stage graph plus the model it serves."""

    version: str = PIPELINE_FILE_VERSION
    name: Annotated[str, Field(min_length=1)]
    preset: str | None = None
    model: ModelSource
    stages: tuple[Stage, ...]
    modalities: tuple[Modality, ...]
    routes: tuple[Route, ...]

    @model_validator(mode="after")
    def _valid_graph(self) -> Self:
        problems = graph_problems(self)
        if problems:
            raise PipelineError(problems)
        return self

    def stage(self, name: str) -> Stage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(f"pipeline {self.name!r} has no stage {name!r}")

    @property
    def entry(self) -> Stage:
        """The stage that receives client requests (the only one without inputs)."""
        return next(s for s in self.stages if not s.inputs)

    @property
    def input_modalities(self) -> tuple[InputModality, ...]:
        """What a chat request may hand the entry stage (:data:`TASK_INPUTS`; text only by default)."""
        return TASK_INPUTS.get(self.entry.task, (InputModality.TEXT,))

    def downstream(self, name: str) -> list[Stage]:
        return [s for s in self.stages if name in s.inputs]

    def exit_for(self, modality: Modality) -> Stage:
        """The stage that emits ``modality`` to the client."""
        for stage in self.stages:
            if modality in stage.outputs:
                return stage
        raise KeyError(f"pipeline {self.name!r} has no exit stage for {modality.value}")

    def stages_for(self, modalities: Iterable[Modality]) -> list[Stage]:
        """Stages a request for ``modalities`` must visit: every ancestor of each exit, in graph order."""
        needed: set[str] = set()
        frontier = [self.exit_for(m).name for m in modalities]
        while frontier:
            name = frontier.pop()
            if name not in needed:
                needed.add(name)
                frontier.extend(self.stage(name).inputs)
        return [s for s in topological_order(self.stages) if s.name in needed]

    def to_json(self) -> str:
        """The ConfigMap payload; stable key order so equal graphs give byte-equal files."""
        return json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True) + "\n"


def topological_order(stages: Iterable[Stage]) -> list[Stage]:
    """Kahn's algorithm, stable by declaration order; raises on cycles."""
    stage_list = list(stages)
    by_name = {s.name: s for s in stage_list}
    remaining = {s.name: {i for i in s.inputs if i in by_name} for s in stage_list}
    order: list[Stage] = []
    while remaining:
        ready = [s.name for s in stage_list if s.name in remaining and not remaining[s.name]]
        if not ready:
            raise PipelineError([("stages", f"cycle: {_describe_cycle(remaining)}")])
        for name in ready:
            order.append(by_name[name])
            del remaining[name]
        for deps in remaining.values():
            deps.difference_update(ready)
    return order


def _describe_cycle(remaining: Mapping[str, set[str]]) -> str:
    """Walk input edges from any stuck stage until a name repeats: that loop is a cycle."""
    start = next(iter(remaining))
    path = [start]
    while True:
        nxt = sorted(remaining[path[-1]])[0]
        if nxt in path:
            loop = [*path[path.index(nxt) :], nxt]
            return " -> ".join(loop)
        path.append(nxt)


def graph_problems(pipeline: Pipeline) -> list[tuple[str, str]]:
    """Every reason ``pipeline`` cannot run, each with the path of the offending field."""
    problems: list[tuple[str, str]] = []
    stages = pipeline.stages
    if not stages:
        return [("stages", "a pipeline needs at least one stage")]

    seen: set[str] = set()
    for stage in stages:
        if stage.name in seen:
            problems.append((f"stages[{stage.name}]", f"duplicate stage name {stage.name!r}"))
        seen.add(stage.name)
    for stage in stages:
        for inp in stage.inputs:
            if inp not in seen:
                problems.append((f"stages[{stage.name}].inputs", f"unknown stage {inp!r}"))
            elif inp == stage.name:
                problems.append((f"stages[{stage.name}].inputs", f"cycle: {inp} -> {inp}"))
    if problems:
        return problems

    try:
        topological_order(stages)
    except PipelineError as err:
        return err.problems

    entries = [s for s in stages if not s.inputs]
    entry = entries[0]
    reachable = {entry.name}
    for stage in topological_order(stages):
        if any(i in reachable for i in stage.inputs):
            reachable.add(stage.name)
    for stage in stages:
        if stage.name not in reachable:
            problems.append(
                (
                    f"stages[{stage.name}]",
                    f"stage {stage.name!r} is unreachable from the entry stage {entry.name!r}",
                )
            )

    for modality in pipeline.modalities:
        if not any(modality in s.outputs for s in stages):
            problems.append(("modalities", f"modality {modality.value!r} has no exit stage (no stage outputs it)"))
    for route in pipeline.routes:
        needed = ROUTE_MODALITY[route]
        if needed is not None and needed not in pipeline.modalities:
            problems.append(("routes", f"route {route.value!r} needs modality {needed.value!r}, which is not served"))
    return problems


def parse_pipeline(data: str | bytes | Mapping[str, Any]) -> Pipeline:
    """Parse the pipeline file (JSON text or a decoded mapping); errors name the field."""
    try:
        if isinstance(data, (str, bytes)):
            return Pipeline.model_validate_json(data)
        return Pipeline.model_validate(data)
    except ValidationError as err:
        raise PipelineError(validation_problems(err)) from None


def validation_problems(err: ValidationError) -> list[tuple[str, str]]:
    """Turn pydantic's errors into ``(path, message)``, unwrapping graph problems raised inside."""
    problems: list[tuple[str, str]] = []
    for e in err.errors():
        inner = (e.get("ctx") or {}).get("error")
        if isinstance(inner, PipelineError):
            problems.extend(inner.problems)
        else:
            message = e["msg"].removeprefix("Value error, ")
            problems.append((".".join(str(p) for p in e["loc"]) or "pipeline", message))
    return problems


def load_pipeline(path: str | Path) -> Pipeline:
    """Read the pipeline file the operator mounted (or the user wrote)."""
    return parse_pipeline(Path(path).read_bytes())
