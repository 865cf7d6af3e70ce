"""Model sources: the build-once tiny cache and the resolution of file:// and pvc:// sources."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import runtime_fakes

from omnimodel_runtime.errors import ModelSourceError
from omnimodel_runtime.models import resolve_model_dir
from omnimodel_runtime.pipeline import ModelSource
from omnimodel_runtime.settings import RuntimeSettings
from omnimodel_runtime.tiny import TINY_BUILDERS, TinyBuilder, ensure_tiny, tiny_presets
from omnimodel_runtime.tiny.cache import MARKER


@pytest.fixture
def counting_builder(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    monkeypatch.setitem(
        TINY_BUILDERS,  # type: ignore[arg-type]
        "counting",
        TinyBuilder(module="runtime_fakes", function="build_counting", extra="transformers", default_seed=3),
    )
    runtime_fakes.BUILDS.clear()
    runtime_fakes.FAIL_BUILDS.clear()
    return runtime_fakes.BUILDS


def test_text_preset_has_a_tiny_model() -> None:
    assert "text" in tiny_presets()


def test_tiny_model_is_built_once_and_reused(tmp_path: Path, counting_builder: list[Path]) -> None:
    first = ensure_tiny("counting", tmp_path)
    second = ensure_tiny("counting", tmp_path)
    assert first == second
    assert len(counting_builder) == 1
    assert (first / MARKER).is_file()
    assert (first / "weights.bin").read_bytes() == bytes([3]) * 16


def test_concurrent_first_use_builds_once(tmp_path: Path, counting_builder: list[Path]) -> None:
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(ensure_tiny("counting", tmp_path))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(counting_builder) == 1
    assert len(set(results)) == 1
    assert len(results) == 4


def test_a_failed_build_leaves_nothing_that_looks_usable(tmp_path: Path, counting_builder: list[Path]) -> None:
    runtime_fakes.FAIL_BUILDS.append(True)
    with pytest.raises(RuntimeError, match="halfway"):
        ensure_tiny("counting", tmp_path)
    leftovers = [p for p in (tmp_path / "tiny").iterdir() if not p.name.endswith(".lock")]
    assert leftovers == []
    runtime_fakes.FAIL_BUILDS.append(False)
    assert (ensure_tiny("counting", tmp_path) / "config.json").is_file()


def test_an_incomplete_directory_from_a_killed_build_is_rebuilt(tmp_path: Path, counting_builder: list[Path]) -> None:
    target = ensure_tiny("counting", tmp_path)
    (target / MARKER).unlink()  # as if the process died before the marker was written
    (target / "config.json").unlink()
    assert (ensure_tiny("counting", tmp_path) / "config.json").is_file()
    assert len(counting_builder) == 2


def test_unknown_tiny_preset_names_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="known: text"):
        ensure_tiny("nope", tmp_path)


def test_file_and_pvc_sources_resolve_to_existing_directories(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    settings = RuntimeSettings(pvc_root=tmp_path)
    assert resolve_model_dir(ModelSource(source=f"file://{model}"), settings) == model
    (tmp_path / "claim" / "sub").mkdir(parents=True)
    assert resolve_model_dir(ModelSource(source="pvc://claim/sub"), settings) == tmp_path / "claim" / "sub"
    with pytest.raises(ModelSourceError, match="not a directory"):
        resolve_model_dir(ModelSource(source=f"file://{tmp_path}/missing"), settings)


def test_tiny_sources_resolve_through_the_model_cache(tmp_path: Path, counting_builder: list[Path]) -> None:
    settings = RuntimeSettings(model_cache=tmp_path)
    path = resolve_model_dir(ModelSource(source="tiny://counting"), settings)
    assert path.is_relative_to(tmp_path)
    assert (path / "config.json").is_file()
