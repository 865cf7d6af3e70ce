"""What goes into and out of a talker request's ``generate()``: its arguments (:class:`_Call`), the thinker's
rows one per decode step (:func:`_head`, :func:`_reply_rows`, :class:`_ReplyRows`: reply rows, then the
text-end and text-pad rows) and the stopping criterion that streams each code to code2wav
(:class:`_Codes`). The engine is :mod:`~omnimodel_runtime.engines.omni.talker`."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers import StoppingCriteria

from omnimodel_runtime.engines.omni.common import CODES_KIND, PROMPT_KIND, REPLY_KIND, RngTurn, tensor_frame
from omnimodel_runtime.engines.omni.engine import OmniJob
from omnimodel_runtime.protocol.stage import FinalFrame, ResponseFrame, TensorFrame

if TYPE_CHECKING:
    from omnimodel_runtime.engines.omni.talker import OmniTalkerEngine


@dataclass(eq=False, kw_only=True)
class _Call:
    """What ``generate()`` gets for one request, and what its decode steps continue from."""

    # What the prompt's M-RoPE positions depend on: audio feature lengths, image and video grids, a
    # video's seconds per temporal patch, whether its audio is interleaved (``use_audio_in_video``).
    media: dict[str, Any]
    input_ids: torch.Tensor
    text_ids: torch.Tensor
    inputs_embeds: torch.Tensor
    reply0: torch.Tensor
    rest: torch.Tensor  # reply rows that came with the first one
    end: torch.Tensor  # text-end row
    pad: torch.Tensor  # text-pad row
    rows: Any  # frame, name -> rows tensor
    generation: dict[str, Any]
    criterion: _Codes

    @property
    def prompt_len(self) -> int:
        return int(self.input_ids.shape[1])


def _head(frames: Iterator[ResponseFrame]) -> tuple[TensorFrame | None, TensorFrame | None]:
    """The thinker's prompt frame and its first reply row (``None`` when it ended before them)."""
    prompt = None
    for frame in frames:
        if isinstance(frame, TensorFrame) and frame.meta.get("kind") == PROMPT_KIND:
            prompt = frame
        elif isinstance(frame, TensorFrame) and frame.meta.get("kind") == REPLY_KIND:
            return prompt, frame
        elif isinstance(frame, FinalFrame):
            break
    return prompt, None


def _reply_rows(frames: Iterator[ResponseFrame], rows: Any, first: torch.Tensor) -> Iterator[torch.Tensor]:
    """Reply rows one at a time, blocking on the thinker (text frames are the client's, not ours)."""
    yield from first
    for frame in frames:
        if isinstance(frame, TensorFrame) and frame.meta.get("kind") == REPLY_KIND:
            yield from rows(frame, "rows")
        elif isinstance(frame, FinalFrame):
            return


class _ReplyRows:
    """Row t for talker step t: reply rows while the thinker has them, then text-end, then text-pad for
    as long as the talker keeps speaking (the whole model's ``thinker_reply_part`` tail)."""

    def __init__(self, rows: Iterator[torch.Tensor], *, end: torch.Tensor, pad: torch.Tensor) -> None:
        self._rows = rows
        self._tail = [end[0], pad[0]]
        self._done = False

    def next(self) -> torch.Tensor:
        if not self._done:
            row = next(self._rows, None)
            if row is not None:
                return row
            self._done = True
        return self._tail.pop(0) if len(self._tail) > 1 else self._tail[0]


class _Codes(StoppingCriteria):  # type: ignore[misc]  # transformers is untyped here
    """Streams each sampled code to code2wav and ends the request's turn on the global generator."""

    def __init__(self, engine: OmniTalkerEngine, job: OmniJob, turn: RngTurn, *, eos: set[int], limit: int) -> None:
        self.engine = engine
        self.job = job
        self.turn = turn
        self.eos = eos
        self.limit = limit
        self.count = 0
        self.reason = "length"
        self.done = False

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **_: Any) -> torch.Tensor:
        self.turn.end()
        self.engine.context.metrics.observe_batch(1)
        self.take(int(input_ids[0, -1]))
        return torch.full((input_ids.shape[0],), self.done, dtype=torch.bool, device=input_ids.device)

    def take(self, code: int) -> bool:
        """Stream ``code`` (the one just sampled); whether speech ends here."""
        if code in self.eos:
            self.done, self.reason = True, "stop"
        else:
            self.count += 1
            self.engine.context.metrics.add_generated_tokens(1)
            self.job.emit(tensor_frame(CODES_KIND, {"codes": np.array([code], dtype=np.int64)}))
            self.done = self.count >= self.limit
            self.job.check()
        return self.done
