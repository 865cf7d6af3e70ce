"""The ``omnimodel`` command line: parsing, serve's pipeline, configuration errors, lazy imports."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from omnimodel_runtime.cli import EXIT_CONFIG, build_parser, main
from omnimodel_runtime.engines.registry import engine_class, supported
from omnimodel_runtime.errors import ExtraMissingError, RuntimeSetupError
from omnimodel_runtime.pipeline import EngineName, PipelineError, Vendor
from omnimodel_runtime.serve import serve_pipeline
from omnimodel_runtime.settings import THREAD_ENV, RuntimeSettings


@pytest.fixture(autouse=True)
def thread_env_kept() -> Iterator[None]:
    """main() sets the thread variables of the process it runs in, here pytest's: put them back after
    (a later test's subprocess would inherit them as the user's)."""
    saved = {name: os.environ.get(name) for name in THREAD_ENV}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


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


def _actions(parser: object) -> list[tuple[str, object]]:
    """Every (command, action) of the parser and its subcommands."""
    import argparse

    assert isinstance(parser, argparse.ArgumentParser)
    out: list[tuple[str, object]] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += [(f"{parser.prog} {name}", a) for _, a in _actions(sub)]
        else:
            out.append((parser.prog, action))
    return out


def test_every_help_entry_is_described() -> None:
    import argparse

    undescribed = [
        (prog, action.option_strings or action.dest)
        for prog, action in _actions(build_parser())
        if isinstance(action, argparse.Action) and not isinstance(action, argparse._HelpAction) and not action.help
    ]
    assert undescribed == []


def test_serve_runs_a_vllm_stage_on_transformers_unless_told_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from omnimodel_runtime.cli import _log_choices

    local = serve_pipeline("text", "tiny://text", local_defaults=True)
    assert local.stage("llm").engine is EngineName.TRANSFORMERS
    assert serve_pipeline("text", "tiny://text", engines=["vllm"], local_defaults=True).stage("llm").engine is (
        EngineName.VLLM
    )
    # The operator's default (what a cluster runs) is still the preset's.
    assert serve_pipeline("text", "tiny://text").stage("llm").engine is EngineName.VLLM
    with caplog.at_level(logging.INFO, logger="omnimodel_runtime.cli"):
        _log_choices(local, [])
    assert "Stage llm: transformers engine, task text-generation (the preset's engine is vllm" in caplog.text


def test_a_tiny_model_of_another_preset_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--preset", "text", "--model", "tiny://tts"]) == EXIT_CONFIG
    err = capsys.readouterr().err.strip()
    assert err == (
        "omnimodel serve: model: tiny://tts is the tiny model of preset 'tts'; --preset text needs tiny://text"
    )


def test_pipeline_command_writes_the_file_stage_and_gateway_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from omnimodel_runtime.pipeline import load_pipeline

    out = tmp_path / "p.json"
    argv = ["pipeline", "--preset", "qwen2.5-omni", "--model", "tiny://qwen2.5-omni", "--out", str(out)]
    urls = ["thinker=http://127.0.0.1:8001", "talker=http://127.0.0.1:8002", "code2wav=http://127.0.0.1:8003"]
    assert main([*argv, *(f"--stage-url={u}" for u in urls), "--stage-url", "thinker=http://127.0.0.1:8011/"]) == 0
    pipeline = load_pipeline(out)
    assert pipeline.stage("thinker").endpoints == ("http://127.0.0.1:8001", "http://127.0.0.1:8011")
    assert pipeline.stage("code2wav").endpoints == ("http://127.0.0.1:8003",)
    capsys.readouterr()
    assert main([*argv, f"--stage-url={urls[0]}"]) == EXIT_CONFIG
    assert "every stage needs a --stage-url; missing: talker, code2wav" in capsys.readouterr().err
    assert main([*argv, "--stage-url", "thinker:8001"]) == EXIT_CONFIG
    assert "STAGE=http://HOST:PORT" in capsys.readouterr().err


@contextlib.contextmanager
def taken_port() -> Iterator[int]:
    """A port something else listens on: run_app gives up on it before any engine loads."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield int(taken.getsockname()[1])


def run_serve_app(settings: RuntimeSettings) -> tuple[int, Any]:
    """run_app on a tiny text ``serve`` app; its exit status and the app."""
    from omnimodel_runtime.cli import run_app
    from omnimodel_runtime.serve import build_serve_app

    app = build_serve_app(settings, serve_pipeline("text", "tiny://text", engines=["transformers"]))
    return run_app(app, settings), app


def test_a_port_in_use_is_one_line_and_nothing_loads(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from omnimodel_runtime.cli import EXIT_FAILED

    with taken_port() as port:
        with caplog.at_level(logging.INFO):
            rc, app = run_serve_app(RuntimeSettings(port=port))
        assert rc == EXIT_FAILED
    (record,) = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert f"Cannot listen on 127.0.0.1:{port}" in record.getMessage()
    assert "in use" in record.getMessage()
    assert record.exc_info is None
    assert app.state.startup.phase.value == "starting"  # the engine never started loading


def test_a_server_sets_the_gil_switch_interval_from_its_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every server (stage, gateway, serve) goes through run_app, which applies OMNIMODEL_GIL_SWITCH_INTERVAL
    (default 0.5 ms, not Python's 5 ms: busy omni workers starve the event loop under 5 ms) first thing."""
    from omnimodel_runtime.cli import EXIT_FAILED

    before = sys.getswitchinterval()
    try:
        with taken_port() as port:
            assert RuntimeSettings(port=port).gil_switch_interval == 0.0005
            monkeypatch.setenv("OMNIMODEL_GIL_SWITCH_INTERVAL", "0.002")
            assert run_serve_app(RuntimeSettings(port=port))[0] == EXIT_FAILED
            assert sys.getswitchinterval() == pytest.approx(0.002)
    finally:
        sys.setswitchinterval(before)


def test_every_setting_is_documented() -> None:
    doc = (Path(__file__).parents[3] / "docs" / "settings.md").read_text()
    missing = [name for name in RuntimeSettings.model_fields if f"`OMNIMODEL_{name.upper()}`" not in doc]
    assert missing == []
