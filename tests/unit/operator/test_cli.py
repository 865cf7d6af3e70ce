"""`omnimodel-operator render` and `crd`, as a user runs them."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from omnimodel_operator.cli import main

REPO = Path(__file__).parents[3]


def test_render_prints_every_child_as_yaml(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["render", "-f", str(REPO / "examples" / "qwen-omni.yaml"), "-n", "ml"]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    kinds = sorted({d["kind"] for d in docs})
    assert kinds == ["ConfigMap", "Deployment", "NetworkPolicy", "Service", "ServiceAccount"]
    assert {d["metadata"]["namespace"] for d in docs} == {"ml"}
    assert sum(d["kind"] == "Deployment" for d in docs) == 4


def write(tmp_path: Path, spec: str) -> str:
    path = tmp_path / "om.yaml"
    path.write_text(f"apiVersion: omnimodel.io/v1alpha1\nkind: OmniModel\nmetadata: {{name: m}}\nspec:\n{spec}")
    return str(path)


def test_cycle_exits_nonzero_and_says_cycle(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = """  model: {source: tiny://text}
  stages:
  - {name: a, kind: ar, engine: vllm, task: text-generation, inputs: [b], outputs: [text]}
  - {name: b, kind: ar, engine: vllm, task: text-generation, inputs: [a]}
"""
    assert main(["render", "-f", write(tmp_path, spec)]) == 2
    err = capsys.readouterr().err
    assert "cycle: a -> b -> a" in err
    assert "spec.stages" in err


def test_bad_field_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = """  model: {source: tiny://text}
  preset: text
  stages:
  - {name: llm, accelerator: {vendor: nvidia, count: 0}}
"""
    assert main(["render", "-f", write(tmp_path, spec)]) == 2
    err = capsys.readouterr().err
    assert "spec.stages[llm].accelerator" in err
    assert "count must be >= 1 for vendor nvidia" in err


def test_unknown_preset_stage_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = """  model: {source: tiny://text}
  preset: qwen2.5-omni
  stages:
  - {name: talkr, replicas: 2}
"""
    assert main(["render", "-f", write(tmp_path, spec)]) == 2
    err = capsys.readouterr().err
    assert "spec.stages[talkr]" in err and "no stage 'talkr'" in err


def test_crd_command_prints_the_committed_crd(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["crd"]) == 0
    assert capsys.readouterr().out == (REPO / "crds" / "omnimodel.io_omnimodels.yaml").read_text()
