"""The stage-graph contract: what a valid pipeline is, and how an invalid one is reported."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from omnimodel_runtime.pipeline import (
    PRESETS,
    EngineName,
    Modality,
    ModelSource,
    Pipeline,
    PipelineError,
    Route,
    Stage,
    StageKind,
    parse_pipeline,
)

MODEL = ModelSource(source="tiny://text")


def stage(name: str, *inputs: str, outputs: tuple[Modality, ...] = ()) -> Stage:
    return Stage(name=name, kind=StageKind.AR, engine=EngineName.TRANSFORMERS, task="t", inputs=inputs, outputs=outputs)


def pipeline(*stages: Stage, modalities: tuple[Modality, ...] = (Modality.TEXT,)) -> Pipeline:
    return Pipeline(name="p", model=MODEL, stages=stages, modalities=modalities, routes=(Route.CHAT,))


def problems(*stages: Stage, modalities: tuple[Modality, ...] = (Modality.TEXT,)) -> list[tuple[str, str]]:
    with pytest.raises(PipelineError) as info:
        parse_pipeline(
            {
                "name": "p",
                "model": MODEL.model_dump(),
                "stages": [s.model_dump() for s in stages],
                "modalities": list(modalities),
                "routes": ["chat"],
            }
        )
    return info.value.problems


def test_duplicate_stage_names_are_named() -> None:
    found = problems(stage("a", outputs=(Modality.TEXT,)), stage("a"))
    assert ("stages[a]", "duplicate stage name 'a'") in found


def test_unknown_input_names_the_stage_and_the_missing_input() -> None:
    found = problems(stage("a", outputs=(Modality.TEXT,)), stage("b", "nope"))
    assert found == [("stages[b].inputs", "unknown stage 'nope'")]


def test_cycle_is_reported_with_its_path() -> None:
    found = problems(stage("a"), stage("b", "a", "c"), stage("c", "b", outputs=(Modality.TEXT,)))
    assert len(found) == 1
    _, message = found[0]
    assert message.startswith("cycle: ")
    assert set(message.removeprefix("cycle: ").split(" -> ")) == {"b", "c"}


def test_self_loop_is_a_cycle() -> None:
    found = problems(stage("a", "a", outputs=(Modality.TEXT,)))
    assert found == [("stages[a].inputs", "cycle: a -> a")]


def test_second_entry_stage_is_unreachable() -> None:
    found = problems(stage("a", outputs=(Modality.TEXT,)), stage("b"))
    assert found == [("stages[b]", "stage 'b' is unreachable from the entry stage 'a'")]


def test_requested_modality_without_exit_stage() -> None:
    found = problems(stage("a", outputs=(Modality.TEXT,)), modalities=(Modality.TEXT, Modality.AUDIO))
    assert found == [("modalities", "modality 'audio' has no exit stage (no stage outputs it)")]


def test_route_needs_its_modality() -> None:
    with pytest.raises(PipelineError, match="route 'images' needs modality 'image'"):
        parse_pipeline(
            {
                "name": "p",
                "model": MODEL.model_dump(),
                "stages": [stage("a", outputs=(Modality.TEXT,)).model_dump()],
                "modalities": ["text"],
                "routes": ["images"],
            }
        )


def test_field_errors_name_the_field() -> None:
    with pytest.raises(PipelineError) as info:
        parse_pipeline('{"name": "p", "model": {"source": "ftp://x"}, "stages": [], "modalities": [], "routes": []}')
    assert info.value.problems[0][0] == "model.source"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_is_a_valid_graph_and_round_trips(name: str) -> None:
    built = PRESETS[name].pipeline(ModelSource(source=f"tiny://{name}"))
    assert parse_pipeline(built.to_json()) == built
    assert built.entry.name == PRESETS[name].stages[0].name


def test_text_only_request_visits_only_the_thinker() -> None:
    omni = PRESETS["qwen2.5-omni"].pipeline(MODEL)
    assert [s.name for s in omni.stages_for([Modality.TEXT])] == ["thinker"]
    assert [s.name for s in omni.stages_for([Modality.TEXT, Modality.AUDIO])] == [
        "thinker",
        "talker",
        "code2wav",
    ]


def test_preset_rejects_overrides_of_unknown_stages_and_graph_fields() -> None:
    with pytest.raises(PipelineError) as info:
        PRESETS["tts"].pipeline(MODEL, overrides={"vocodr": {}, "acoustic": {"inputs": ("vocoder",)}})
    paths = [p for p, _ in info.value.problems]
    assert paths == ["stages[vocodr]", "stages[acoustic].inputs"]


# ---------------------------------------------------------------------------------- property tests

names = st.lists(st.from_regex(r"[a-z][a-z0-9]{0,6}", fullmatch=True), min_size=1, max_size=8, unique=True)


@st.composite
def dags(draw: st.DrawFn) -> list[Stage]:
    """Random connected DAGs: every stage after the first takes at least one earlier stage."""
    stage_names = draw(names)
    stages = [stage(stage_names[0])]
    for i, n in enumerate(stage_names[1:], start=1):
        ins = draw(st.lists(st.sampled_from(stage_names[:i]), min_size=1, max_size=3, unique=True))
        stages.append(stage(n, *ins))
    last = stages[-1]
    stages[-1] = last.model_copy(update={"outputs": (Modality.TEXT,)})
    return stages


@given(dags())
def test_any_connected_dag_is_valid_and_ordered(stages: list[Stage]) -> None:
    built = pipeline(*stages)
    order = [s.name for s in built.stages_for([Modality.TEXT])]
    for s in built.stages:
        for i in s.inputs:
            if s.name in order:
                assert order.index(i) < order.index(s.name)


@given(dags(), st.data())
def test_adding_a_back_edge_is_always_reported_as_a_cycle(stages: list[Stage], data: st.DataObject) -> None:
    if len(stages) < 2:
        return
    src = data.draw(st.integers(min_value=1, max_value=len(stages) - 1))
    # the first stage takes an input from a later one: a path back to it exists, so a cycle forms
    ancestor = stages[0]
    stages[0] = ancestor.model_copy(update={"inputs": (stages[src].name,)})
    found = problems(*stages)
    assert any("cycle" in message for _, message in found)
