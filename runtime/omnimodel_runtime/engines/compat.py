"""The few transformers APIs whose spelling differs across the releases the project allows.

``pyproject.toml`` allows ``transformers>=5.19``; CI runs the lowest allowed release in ``.venv`` and the
newest one in a second venv (``make test-newest``). Where a name moved between them, engines ask here.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any


@functools.cache
def _takes(forward: Any, name: str) -> bool:
    return name in inspect.signature(forward).parameters


def cache_kwargs(module: Any, cache: Any) -> dict[str, Any]:
    """The KV cache argument of ``module``'s forward: ``cache`` in newer releases (``past_key_values``
    warns there, deprecated), ``past_key_values`` in older ones."""
    name = "cache" if _takes(type(module).forward, "cache") else "past_key_values"
    return {name: cache}


def output_cache(output: Any) -> Any:
    """The KV cache a forward returned (``output.cache`` in newer releases, ``past_key_values`` before)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values
