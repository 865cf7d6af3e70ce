"""The batched talker's parts outside its engine: a request's row (:class:`_TalkerRow`: its thinker input so
far and its decode slot's state), a queued decode step (:class:`_Step`) and the per-row sampling that keeps
each request's random stream its own (:func:`draw`). The engine is
:mod:`~omnimodel_runtime.engines.omni.talker`."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Final

import torch

from omnimodel_runtime.engines.omni.common import PROMPT_KIND, REPLY_KIND
from omnimodel_runtime.engines.omni.engine import OmniJob
from omnimodel_runtime.engines.omni.talker_stream import _Call
from omnimodel_runtime.protocol.stage import FinalFrame, ResponseFrame, TensorFrame


def draw(probs: torch.Tensor, generators: list[torch.Generator]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One sample per row of ``probs`` from that row's generator, and each generator's state before its draw.

    ``torch.multinomial(probs[k : k + 1], 1)``'s own algorithm (``argmax(p / q)``, ``q ~ Exp(1)`` drawn on a
    tensor of the row's shape, so the same numbers), without its validity check, which waits for the
    device in the torch releases that read it back. The states let a request found to have ended on the
    step before report its stream as if this draw never happened."""
    before = [gen.get_state() for gen in generators]
    noise = [torch.empty_like(probs[k : k + 1]).exponential_(1, generator=gen) for k, gen in enumerate(generators)]
    picks: torch.Tensor = (probs / torch.cat(noise)).argmax(dim=-1)
    return picks, before


# Generation parameters the batched talker applies (others are the one-at-a-time path's only).
_BATCHED_KEYS: Final = frozenset(
    {"max_new_tokens", "do_sample", "top_k", "top_p", "temperature", "repetition_penalty", "eos_token_id"}
)


@dataclass(eq=False, kw_only=True)
class _Step:
    """A queued batched decode step: its rows and their sampled codes (on the host once ``event`` is done;
    ``None``: already there)."""

    number: int
    rows: list[_TalkerRow]
    codes: torch.Tensor
    event: Any


@dataclass(eq=False, kw_only=True)
class _TalkerRow:
    """A request of the batched talker: its thinker input so far and, once prefilled, its slot state."""

    job: OmniJob
    prompt: TensorFrame | None = None
    first: TensorFrame | None = None
    later: list[TensorFrame] = field(default_factory=list)  # reply frames that came before the prefill
    rows: deque[torch.Tensor] = field(default_factory=deque)
    upstream_done: bool = False
    tail: int = 0  # tail rows used (text-end, then text-pad)
    call: _Call | None = None
    generator: torch.Generator | None = None
    length: int = 0
    delta: int = 0
    history: int = 0
    steps: int = 0  # decode steps queued
    launched: int = 0  # the number of the last step queued for it
    before: torch.Tensor | None = None  # its generator's state before that step's draw
    final: bool = False  # its last step is queued (code cap or slot capacity)
    over: bool = False  # answered: codes of steps queued since are dropped

    def take(self, frames: list[ResponseFrame]) -> None:
        for frame in frames:
            if isinstance(frame, TensorFrame) and frame.meta.get("kind") == PROMPT_KIND:
                self.prompt = frame
            elif isinstance(frame, TensorFrame) and frame.meta.get("kind") == REPLY_KIND:
                if self.first is None:
                    self.first = frame
                elif self.call is None:
                    self.later.append(frame)
                else:
                    self.rows.extend(self.call.rows(frame, "rows"))
            elif isinstance(frame, FinalFrame):
                self.upstream_done = True
        if self.job.ended:
            self.upstream_done = True

    @property
    def ready(self) -> bool:
        """Whether the row for the next step is here (thinker rows, or the tail once the thinker ended)."""
        return self.call is not None and (bool(self.rows) or self.upstream_done)

    @property
    def launchable(self) -> bool:
        """Whether a step can be queued for it: its input is here and its speech may go on."""
        return self.ready and not self.final and not self.over

    def next_row(self) -> torch.Tensor:
        """Row t for step t: reply rows, then text-end, then text-pad (as :class:`_ReplyRows`)."""
        assert self.call is not None
        if self.rows:
            return self.rows.popleft()
        self.tail += 1
        return self.call.end[0] if self.tail == 1 else self.call.pad[0]
