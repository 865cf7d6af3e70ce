"""Handing results from an engine's worker thread back to the event loop.

Every engine runs its blocking model work on a worker thread; these are the only ways it touches
asyncio objects, always through ``call_soon_threadsafe`` (futures are not thread-safe).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any


def post(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    """``call_soon_threadsafe`` that tolerates a loop already closed at shutdown (nobody listens then)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn, *args)


def set_result(fut: asyncio.Future[Any], value: Any = None) -> None:
    """Resolve ``fut`` unless its waiter already gave up (cancelled)."""
    if not fut.done():
        fut.set_result(value)


def set_exception(fut: asyncio.Future[Any], err: BaseException) -> None:
    """Fail ``fut`` unless its waiter already gave up (cancelled)."""
    if not fut.done():
        fut.set_exception(err)
