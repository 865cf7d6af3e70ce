"""Fixtures for runtime component tests: the tiny models, each built once per session (``tiny_*``) and
shared by every test, and the whole Qwen2.5-Omni and Qwen3-Omni they are compared against."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from omni_helpers import Qwen3Whole, Qwen25Whole

# pytest runs with --import-mode=importlib, which puts no test directory on sys.path; the test modules
# here share runtime_procs.py, stage_engines.py and omni_helpers.py (plain helpers, not fixtures), so this
# directory goes on the path first.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session", autouse=True)
def openai_clients() -> Iterator[None]:
    """The clients runtime_procs.openai_client made, closed once the session's tests are done."""
    from runtime_procs import close_openai_clients

    yield
    close_openai_clients()


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model cache of this session (``OMNIMODEL_TEST_MODEL_CACHE`` reuses one across sessions)."""
    given = os.environ.get("OMNIMODEL_TEST_MODEL_CACHE")
    return Path(given) if given else tmp_path_factory.mktemp("model-cache")


def _tiny(preset: str) -> Any:
    """A session fixture: the tiny model of ``preset`` (built in seconds)."""

    def tiny(model_cache: Path) -> Path:
        from omnimodel_runtime.tiny import ensure_tiny

        return ensure_tiny(preset, model_cache)

    tiny.__doc__ = f"The tiny {preset} model, built once for the whole session."
    return pytest.fixture(tiny, scope="session")


# The fixture's name is the one it is bound to here.
tiny_text = _tiny("text")
tiny_omni = _tiny("qwen2.5-omni")
tiny_qwen3 = _tiny("qwen3-omni")
tiny_t2i = _tiny("text-to-image")
tiny_edit = _tiny("qwen-image-edit")
tiny_tts = _tiny("tts")
tiny_t2v = _tiny("text-to-video")


@pytest.fixture(scope="session")
def whole_omni(tiny_omni: Path) -> Qwen25Whole:
    """The unsplit tiny Qwen2.5-Omni (transformers' own), loaded once for the whole session."""
    from omni_helpers import Qwen25Whole

    return Qwen25Whole(tiny_omni)


@pytest.fixture(scope="session")
def whole_qwen3(tiny_qwen3: Path) -> Qwen3Whole:
    """The unsplit tiny Qwen3-Omni (transformers' own), loaded once for the whole session."""
    from omni_helpers import Qwen3Whole

    return Qwen3Whole(tiny_qwen3)
