"""Server-sent events as the OpenAI API streams them: ``data: {json}`` events ending with ``[DONE]``."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Final

from pydantic import BaseModel

from omnimodel_runtime.errors import StageError
from omnimodel_runtime.serving.base import aclose
from omnimodel_runtime.serving.errors import error_body

log = logging.getLogger(__name__)

DONE: Final = b"data: [DONE]\n\n"


def sse(data: BaseModel | dict[str, Any], *, event: str | None = None) -> bytes:
    """One server-sent event carrying ``data`` as JSON (with an ``event:`` name when given, as OpenAI's
    image streams name theirs)."""
    payload = data.model_dump_json(exclude_unset=False) if isinstance(data, BaseModel) else json.dumps(data)
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n".encode()


async def event_stream(events: AsyncGenerator[bytes, None], source: AsyncIterator[Any]) -> AsyncIterator[bytes]:
    """An SSE body: ``events`` as they come, then ``[DONE]``.

    Once the stream has started its HTTP status is sent, so a failure becomes an error event (the OpenAI
    envelope) followed by ``[DONE]``. ``source``, the frames behind the events, is closed however the
    body ends (finished, failed, or the client gone), which cancels every stage still working for it.
    """
    try:
        async with contextlib.aclosing(events):
            async for event in events:
                yield event
    except StageError as err:
        yield sse(error_body(err))
    except Exception as err:
        log.exception("Streaming a response failed")
        yield sse(error_body(StageError(f"internal error: {err}", status=500)))
    finally:
        with contextlib.suppress(Exception):
            await aclose(source)
    yield DONE
