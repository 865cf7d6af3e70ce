"""Fixtures for the chart and image tests: the helm binary, and ``helm template`` as a function."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

# pytest runs with --import-mode=importlib, which puts no test directory on sys.path; the test modules
# here share chartkit.py (plain helpers, not fixtures), so this directory goes on the path first.
sys.path.insert(0, str(Path(__file__).parent))

from chartkit import Manifest, Render, RenderError, find_helm, run_helm, template_args


@pytest.fixture(scope="session")
def helm() -> str:
    path = find_helm()
    if path is None:
        pytest.fail("no helm binary: run `make cluster-build` (the test bed builds helm) or set $HELM")
    return path


@pytest.fixture
def render(helm: str, tmp_path: Path) -> Render:
    """``render(values)`` → the manifests ``helm template`` prints, hooks (helm test) included."""

    def _render(values: Mapping[str, Any] | None = None) -> list[Manifest]:
        out = run_helm(helm, *template_args(values, tmp_path)).stdout
        return [doc for doc in yaml.safe_load_all(out) if doc]

    return _render


@pytest.fixture
def render_error(helm: str, tmp_path: Path) -> RenderError:
    """``render_error(values)`` → helm's error text; fails the test if the render succeeds."""

    def _render_error(values: Mapping[str, Any]) -> str:
        proc = run_helm(helm, *template_args(values, tmp_path), check=False)
        assert proc.returncode != 0, f"helm template accepted {values!r}"
        return proc.stderr

    return _render_error
