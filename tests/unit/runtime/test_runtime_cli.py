"""The ``omnimodel`` command line: parsing, serve's pipeline, configuration errors, lazy imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from omnimodel_runtime.cli import EXIT_CONFIG, build_parser, main
from omnimodel_runtime.engines.registry import engine_class, supported
from omnimodel_runtime.errors import ExtraMissingError, RuntimeSetupError
from omnimodel_runtime.pipeline import EngineName, PipelineError, Vendor
from omnimodel_runtime.serve import serve_pipeline
from omnimodel_runtime.settings import RuntimeSettings


def test_help_and_gateway_imports_stay_free_of_torch() -> None:
    # A gateway pod has no use for torch; `omnimodel --help` must be instant.
    code = (
        "import sys; from omnimodel_runtime.cli import build_parser; build_parser();"
        "import omnimodel_runtime.gateway, omnimodel_runtime.stage.server;"
        "heavy = [m for m in ('torch', 'transformers', 'vllm') if m in sys.modules];"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_serve_pipeline_applies_engine_and_local_accelerator() -> None:
    pipeline = serve_pipeline("text", "tiny://text", engines=["transformers"], device="cpu")
    (stage,) = pipeline.stages
    assert stage.engine is EngineName.TRANSFORMERS
    assert stage.accelerator.vendor is Vendor.CPU
    assert pipeline.model.name == "text"
    named = serve_pipeline(
        "qwen2.5-omni",
        "tiny://qwen2.5-omni",
        engines=["talker=vllm"],
        engine_args={"max_model_len": 512},
        served_model_name="omni",
    )
    assert named.stage("talker").engine is EngineName.VLLM
    assert named.stage("thinker").engine is EngineName.TRANSFORMERS
    assert named.stage("thinker").engine_args == {"max_model_len": 512}
    assert named.model.name == "omni"


def test_serve_pipeline_rejects_unknown_stages_and_engines() -> None:
    with pytest.raises(PipelineError, match="no stage 'nope'"):
        serve_pipeline("text", "tiny://text", engines=["nope=vllm"])
    with pytest.raises(PipelineError, match="engine"):
        serve_pipeline("text", "tiny://text", engines=["tensorrt"])
    with pytest.raises(PipelineError, match="unknown preset"):
        serve_pipeline("nope", "tiny://text")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--preset", "nope", "--model", "tiny://text"], "unknown preset"),
        (["serve", "--preset", "text", "--model", "s3://bucket"], "source"),
        (["gateway", "--pipeline", "/nonexistent/pipeline.json"], "No such file"),
        (["serve", "--preset", "text", "--model", "tiny://text", "--engine-arg", "novalue"], "KEY=VALUE"),
    ],
)
def test_configuration_errors_exit_2_with_a_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == EXIT_CONFIG
    assert message in capsys.readouterr().err


def test_stage_command_names_the_stages_when_one_is_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "pipeline.json"
    path.write_text(serve_pipeline("text", "tiny://text").to_json())
    assert main(["stage", "--pipeline", str(path), "--stage", "thinker"]) == EXIT_CONFIG
    assert "has no stage 'thinker' (it has llm)" in capsys.readouterr().err


def test_invalid_pipeline_file_is_reported_with_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "pipeline.json"
    path.write_text('{"name": "x"}')
    assert main(["gateway", "--pipeline", str(path)]) == EXIT_CONFIG
    assert "model" in capsys.readouterr().err


def test_settings_come_from_omnimodel_env_and_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNIMODEL_PORT", "9000")
    monkeypatch.setenv("OMNIMODEL_DEVICE", "cuda")
    monkeypatch.setenv("OMNIMODEL_API_KEY", "s3cr3t-value")
    monkeypatch.setenv("OMNIMODEL_MODEL_CACHE", "/models")
    settings = RuntimeSettings()
    assert (settings.port, settings.device, str(settings.model_cache)) == (9000, "cuda", "/models")
    assert settings.api_key is not None
    assert settings.api_key.get_secret_value() == "s3cr3t-value"
    assert "s3cr3t-value" not in repr(settings)
    assert RuntimeSettings(port=1234).port == 1234
    monkeypatch.setenv("OMNIMODEL_DEVICE", "tpu")
    with pytest.raises(ValueError, match="device"):
        RuntimeSettings()


def test_parser_knows_every_command() -> None:
    parser = build_parser()
    for argv in (
        ["stage", "--pipeline", "p", "--stage", "s"],
        ["gateway", "--pipeline", "p"],
        ["serve", "--preset", "text", "--model", "tiny://text", "--engine", "vllm"],
        ["make-tiny", "--preset", "text", "--out", "d"],
        ["bench", "--concurrency", "4"],
    ):
        assert parser.parse_args(argv).command == argv[0]


def test_engine_registry_names_what_it_knows_and_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ("transformers", "text-generation") in supported()
    assert ("vllm", "text-generation") in supported()
    with pytest.raises(RuntimeSetupError, match=r"no engine adapter .* 'omni-talker'"):
        engine_class(EngineName.VLLM, "omni-talker")
    # A missing library becomes an error naming the extra to install.
    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.delitem(sys.modules, "omnimodel_runtime.engines.text.vllm", raising=False)
    with pytest.raises(ExtraMissingError, match=r"omnimodel\[vllm\]"):
        engine_class(EngineName.VLLM, "text-generation")
