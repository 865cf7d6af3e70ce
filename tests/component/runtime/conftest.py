"""Fixtures for runtime component tests: one tiny text model per session, shared by every test."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# pytest runs with --import-mode=importlib, which puts no test directory on sys.path; the test modules
# here share runtime_procs.py (plain helpers, not fixtures), so this directory goes on the path first.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model cache of this session (``OMNIMODEL_TEST_MODEL_CACHE`` reuses one across sessions)."""
    given = os.environ.get("OMNIMODEL_TEST_MODEL_CACHE")
    return Path(given) if given else tmp_path_factory.mktemp("model-cache")


@pytest.fixture(scope="session")
def tiny_text(model_cache: Path) -> Path:
    """The tiny text model, built once for the whole session (a few seconds)."""
    from omnimodel_runtime.tiny import ensure_tiny

    return ensure_tiny("text", model_cache)
