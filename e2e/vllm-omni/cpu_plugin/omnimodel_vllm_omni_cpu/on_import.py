"""Patch a vLLM-Omni module when it is first imported (or now, if it already is), for the CPU fixes.

Each fix replaces a function or class in one module, which vLLM-Omni imports lazily and in several
processes; this plugin runs before that, so the patch waits in ``sys.meta_path`` for the import.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

Patch = Callable[[ModuleType], None]


class _Finder(importlib.abc.MetaPathFinder):
    """Finds ``targets`` as Python would, then runs ``patch`` on each right after it executes."""

    def __init__(self, targets: frozenset[str], patch: Patch) -> None:
        self.targets = targets
        self.patch = patch

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name not in self.targets:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        exec_module = loader.exec_module
        patch = self.patch

        def exec_and_patch(module: ModuleType) -> None:
            exec_module(module)
            patch(module)

        loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def patch_on_import(targets: Iterable[str], patch: Patch) -> None:
    """Run ``patch`` on each of ``targets`` now where imported, else when it is. Idempotent per ``patch``
    (the patches themselves mark what they replaced, so running one twice changes nothing)."""
    names = frozenset(targets)
    for name in names:
        module = sys.modules.get(name)
        if module is not None:
            patch(module)
    if not any(isinstance(f, _Finder) and f.patch is patch for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(names, patch))
