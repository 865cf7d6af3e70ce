"""Classifier-free guidance in one batched transformer pass (``engine_args: {cfg_batch: true}``).

diffusers' true-CFG pipelines (``QwenImagePipeline``) call the transformer twice per step, positive branch
then negative, on the same latents; at small sizes each call is launch-bound, so two calls cost almost
twice one call of twice the batch. :class:`BatchedGuidance`, entered around one pipeline call, answers
the positive call with one transformer call on ``[positive; negative]`` (the family pads both prompt
embeddings to one length and masks the padding) and the negative call that follows from what that call
left. Everything else is the pipeline's own code: its encoding, its loop, its guidance combination
(Qwen-Image's norm rescale included), its scheduler.

It never guesses. The negative embeddings are the pipeline's own: the second ``encode_prompt`` result of
the call (the pipeline encodes the positive prompt, then the negative one when guidance is on). A negative
call is answered from the batched one only when it passes the very tensors that batch used (the step's
latents, the negative embeddings and mask, by identity); any other call runs the transformer as usual. So
a pipeline that calls in another order, or without guidance, is still right, only not faster.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import torch

# Returns the transformer kwargs of one call on both branches, or None where the family cannot merge them
# (keyword ``text_lengths``: whether the transformer's blocks take each row's prompt length).
Merge = Callable[..., dict[str, Any] | None]

# The attention kwarg with each row's real prompt length, and the attribute set on a transformer whose
# blocks take it (engines/t2i/fused.py).
TEXT_LENGTHS: Final = "text_lengths"
TAKES_TEXT_LENGTHS: Final = "omnimodel_takes_text_lengths"

_MISSING: Final = object()


@dataclass(eq=False)
class _Pending:
    """The negative half of a batched call, kept for the negative call of the same step."""

    latents: torch.Tensor
    negative: tuple[Any, ...]
    output: torch.Tensor


class BatchedGuidance:
    """Context manager over one pipeline call (module docstring); ``merge`` is the family's."""

    def __init__(self, pipe: Any, merge: Merge) -> None:
        self._pipe = pipe
        self._transformer = pipe.transformer
        self._merge = merge
        self._encoded: list[tuple[Any, ...]] = []
        self._negative: tuple[Any, ...] | None = None
        self._pending: _Pending | None = None
        self._saved: dict[str, Any] = {}
        self.batched_calls = 0
        self.answered_calls = 0

    def __enter__(self) -> BatchedGuidance:
        # Instance attributes shadow the class's methods for this call only (diffusers' own hooks patch
        # ``forward`` the same way; whatever is there now is what runs inside).
        self._saved = {
            "forward": self._transformer.__dict__.get("forward", _MISSING),
            "encode_prompt": self._pipe.__dict__.get("encode_prompt", _MISSING),
        }
        self._forward = self._transformer.forward
        self._encode = self._pipe.encode_prompt
        self._transformer.forward = types.MethodType(_forward_of(self), self._transformer)
        self._pipe.encode_prompt = self._encode_prompt
        return self

    def __exit__(self, *exc: object) -> None:
        for target, name in ((self._transformer, "forward"), (self._pipe, "encode_prompt")):
            saved = self._saved[name]
            if saved is _MISSING:
                target.__dict__.pop(name, None)
            else:
                setattr(target, name, saved)
        self._pending = None
        self._negative = None
        self._encoded.clear()

    def _encode_prompt(self, *args: Any, **kwargs: Any) -> Any:
        result = self._encode(*args, **kwargs)
        self._encoded.append(tuple(result))
        return result

    def call(self, kwargs: dict[str, Any]) -> Any:
        """One transformer call of the pipeline (keyword arguments, as diffusers' pipelines pass them)."""
        if self._encoded:
            # The first transformer call: encoding is over; a second result is the negative prompt's.
            self._negative = self._encoded[1] if len(self._encoded) == 2 else None
            self._encoded.clear()
        latents = kwargs.get("hidden_states")
        pending, self._pending = self._pending, None
        if pending is not None and latents is pending.latents:
            negative = (kwargs.get("encoder_hidden_states"), kwargs.get("encoder_hidden_states_mask"))
            if all(a is b for a, b in zip(negative, pending.negative, strict=True)):
                self.answered_calls += 1
                return (pending.output,)
            return self._forward(**kwargs)
        if self._negative is None or kwargs.get("return_dict", True) or not isinstance(latents, torch.Tensor):
            return self._forward(**kwargs)
        merged = self._merge(kwargs, self._negative, text_lengths=getattr(self._transformer, TAKES_TEXT_LENGTHS, False))
        if merged is None:
            return self._forward(**kwargs)
        both = self._forward(**merged)[0]
        positive, negative_out = both.chunk(2)
        self._pending = _Pending(latents=latents, negative=self._negative[:2], output=negative_out)
        self.batched_calls += 1
        return (positive,)


def _forward_of(guidance: BatchedGuidance) -> Callable[..., Any]:
    def forward(module: Any, *args: Any, **kwargs: Any) -> Any:
        if args:  # not the pipelines' keyword protocol: nothing to pair
            return guidance._forward(*args, **kwargs)
        return guidance.call(kwargs)

    return forward
