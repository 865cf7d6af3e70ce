"""How routes answer: a JSON body or an SSE stream, and nothing at all for a client that went away."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import Final, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from omnimodel_runtime.web.streaming import StreamResponse

T = TypeVar("T")

SSE_HEADERS: Final = {"cache-control": "no-cache", "x-accel-buffering": "no"}


class ClientGoneError(Exception):
    """The client disconnected before its (non-streamed) response was ready."""


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client disconnects first; then cancel it (aborting the generation)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.create_task(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        for t in (task, watcher):
            t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
        raise
    watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientGoneError
    return task.result()


def respond(result: BaseModel | AsyncIterator[bytes]) -> Response:
    """A whole response as JSON, or an SSE body as a stream that stops when the client leaves."""
    if isinstance(result, AsyncIterator):
        return StreamResponse(result, media_type="text/event-stream", headers=SSE_HEADERS)
    return JSONResponse(result.model_dump(mode="json"))
