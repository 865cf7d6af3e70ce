"""The committed vLLM-Omni catalogue: loads with the operator's models and holds the invariants renders rely on."""

from __future__ import annotations

import re

import pytest

from omnimodel_operator.vllm_omni import Catalogue, DeployConfigEntry, load_catalogue

DNS_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
CATALOGUE = load_catalogue()


def test_catalogue_is_for_the_pinned_release() -> None:
    assert isinstance(CATALOGUE, Catalogue)
    assert CATALOGUE.vllm_omni_version == "0.30.0"
    assert len(CATALOGUE.configs) >= 100  # 110 bundled YAMLs in 0.30.0
    assert CATALOGUE.names() == sorted(CATALOGUE.names())
    assert len(set(CATALOGUE.names())) == len(CATALOGUE.names())


@pytest.mark.parametrize("entry", CATALOGUE.configs, ids=lambda e: e.name)
def test_every_config_is_a_renderable_graph(entry: DeployConfigEntry) -> None:
    ids = [s.id for s in entry.stages]
    assert ids, "at least one stage"
    assert ids == sorted(set(ids))
    names = [s.name for s in entry.stages]
    assert len(set(names)) == len(names), "stage names are unique"
    assert all(DNS_LABEL.match(n) for n in names), names
    for stage in entry.stages:
        assert set(stage.inputs) <= set(ids) - {stage.id}, f"stage {stage.id} inputs {stage.inputs}"
        assert stage.devices_per_replica >= stage.tensor_parallel_size or stage.type == "diffusion"
    assert any(not s.inputs for s in entry.stages), "an entry stage"
    assert any(s.final_output for s in entry.stages), "a final stage"
    assert {(e.from_, e.to) for e in entry.edges} == {(src, s.id) for s in entry.stages for src in s.inputs}
    assert entry.same_host_only == any(e.same_host_only for e in entry.edges)
    assert entry.final_outputs == sorted({s.final_output_type for s in entry.stages if s.final_output_type})


def test_lookup_by_name_and_stage() -> None:
    omni = CATALOGUE.get("qwen2_5_omni.yaml")
    assert [(s.id, s.name, s.type) for s in omni.stages] == [
        (0, "thinker", "ar"),
        (1, "talker", "ar"),
        (2, "code2wav", "generation"),
    ]
    assert omni.stage("talker").inputs == [0]
    assert omni.head_stage.name == "thinker"
    assert {"chat.completions", "audio.speech"} <= set(omni.routes)
    # Qwen2.5-Omni names no connector: vLLM-Omni's default shared-memory connector joins its stages.
    assert all(e.connector == "SharedMemoryConnector" and e.same_host_only for e in omni.edges)
    with pytest.raises(KeyError, match="no stage 'vocoder'"):
        omni.stage("vocoder")
    with pytest.raises(KeyError, match="not a bundled"):
        CATALOGUE.get("no_such_config")


def test_single_stage_diffusion_config_has_no_edges() -> None:
    wan = CATALOGUE.get("wan2_2_ti2v")
    assert [(s.name, s.type, s.final_output_type) for s in wan.stages] == [("dit", "diffusion", "video")]
    assert wan.edges == []
    assert wan.routes == ["videos"]
    assert not wan.same_host_only
