"""What watches a thinker request's ``generate()``: the stopping criterion that streams its text and stops
it (:class:`_Stream`), the logits processor that forces a given reply (:class:`_Force`) and the forward hook
that streams the talker's rows (:class:`_RowHook`, with :func:`talker_media`). Frame layouts:
docs/pipelines/qwen2.5-omni.md. The engine is :mod:`~omnimodel_runtime.engines.omni.thinker`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers import LogitsProcessor, StoppingCriteria

from omnimodel_runtime.engines.omni.common import (
    AUDIO_LENGTHS,
    IMAGE_GRID,
    PROMPT_KIND,
    REPLY_KIND,
    USE_AUDIO_IN_VIDEO,
    VIDEO_GRID,
    VIDEO_SECONDS,
    RngTurn,
    rows_to_wire,
    tensor_frame,
)
from omnimodel_runtime.engines.omni.engine import OmniJob
from omnimodel_runtime.engines.text.common import IncrementalDetokenizer, ResolvedSampling
from omnimodel_runtime.protocol.stage import TextFrame

if TYPE_CHECKING:
    from omnimodel_runtime.engines.omni.thinker import OmniThinkerEngine


def talker_media(media: dict[str, Any] | None) -> dict[str, np.ndarray]:
    """What the talker's M-RoPE needs of a request's media (the whole model passes it the same): each
    audio's feature length, each image's and video's patch grid, each video's seconds per temporal patch."""
    if media is None:
        return {}
    inputs: dict[str, torch.Tensor] = media["inputs"]
    out: dict[str, np.ndarray] = {}
    if "feature_attention_mask" in inputs:
        out[AUDIO_LENGTHS] = inputs["feature_attention_mask"].sum(dim=-1).to(torch.int64).numpy()
    for grid in (IMAGE_GRID, VIDEO_GRID):
        if grid in inputs:
            out[grid] = inputs[grid].to(torch.int64).numpy()
    if VIDEO_SECONDS in inputs:
        out[VIDEO_SECONDS] = inputs[VIDEO_SECONDS].to(torch.float32).numpy()
    return out


class _Stream(StoppingCriteria):  # type: ignore[misc]  # transformers is untyped here
    """Called by ``generate()`` right after each token is drawn: streams it and decides whether to stop."""

    def __init__(
        self, engine: OmniThinkerEngine, job: OmniJob, sampling: ResolvedSampling, turn: RngTurn | None
    ) -> None:
        self.engine = engine
        self.job = job
        self.sampling = sampling
        self.turn = turn
        self.detok = IncrementalDetokenizer(engine._detok_tokenizer, sampling.stop)
        self.tokens: list[int] = []
        self.reason: str | None = None
        self.limit = min(sampling.max_tokens, engine._max_model_len - len(job.data["prompt_ids"]))
        self.reply: list[int] | None = job.data.get("reply")

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **_: Any) -> torch.Tensor:
        if self.turn is not None:
            self.turn.end()
        self.engine.context.metrics.observe_batch(1)
        stop = self.take(int(input_ids[0, -1]))
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)

    def take(self, token: int) -> bool:
        """Stream ``token`` (the one just picked); whether the request stops here."""
        self.tokens.append(token)
        metrics = self.engine.context.metrics
        if self.reply is not None:
            return self._forced()
        metrics.add_generated_tokens(1)
        if not self.sampling.ignore_eos and token in self.engine._defaults.eos_token_ids:
            self.reason, text = "stop", self.detok.flush()
        else:
            text = self.detok.add(token)
            if self.detok.stopped:
                self.reason = "stop"
            elif len(self.tokens) >= self.limit:
                self.reason = "length"
                text += self.detok.flush()
        if self.job.request.stream:
            self.job.emit(TextFrame(text=text, token_ids=(token,)))
        if self.reason is None:
            self.job.check()
        return self.reason is not None

    def _forced(self) -> bool:
        """A forced reply: no text for anyone; stop once the step that consumes its last token has run,
        i.e. when the token after it (whatever it is, it is never used) has been picked."""
        assert self.reply is not None
        if len(self.tokens) <= len(self.reply):
            self.engine.context.metrics.add_generated_tokens(1)
            self.job.check()
        else:
            self.reason = "stop"
        return self.reason is not None


class _Force(LogitsProcessor):  # type: ignore[misc]  # transformers is untyped here
    """Makes greedy decoding pick ``reply[t]`` at step t (every other token gets -inf); the step after
    the reply is left alone (its token is never consumed)."""

    def __init__(self, reply: list[int], prompt_len: int) -> None:
        self.reply = reply
        self.prompt_len = prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.prompt_len
        if step >= len(self.reply):
            return scores
        forced = torch.full_like(scores, float("-inf"))
        forced[:, self.reply[step]] = 0.0
        return forced


class _RowHook:
    """Forward hook on the thinker's text model: turns each step into talker rows, the ones the engine's
    family sends (:meth:`OmniThinkerEngine.prompt_rows` after the prefill, then
    :meth:`OmniThinkerEngine.reply_rows` for each decode step)."""

    def __init__(self, engine: OmniThinkerEngine, job: OmniJob, stream: _Stream) -> None:
        self.engine = engine
        self.job = job
        self.stream = stream
        self.prefilled = False

    def __call__(self, module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        embeds: torch.Tensor = kwargs["inputs_embeds"][0]
        if not self.prefilled:
            self.prefilled = True
            data = self.job.data
            rows, dtype = rows_to_wire(self.engine.prompt_rows(embeds, output, self.job))
            special, _ = rows_to_wire(self.engine.special_rows(data["speaker_bos"]))
            tensors = {
                "prompt_rows": rows,
                "prompt_ids": np.array(data["prompt_ids"], dtype=np.int64),
                "special_rows": special,
            }
            media = data.get("media")
            tensors.update(talker_media(media))
            meta = {
                self.engine.speaker_meta: data["speaker_bos"],
                USE_AUDIO_IN_VIDEO: bool(media and media.get(USE_AUDIO_IN_VIDEO)),
            }
            self.job.emit(tensor_frame(PROMPT_KIND, tensors, dtype=dtype, **meta))
            return
        # A decode step's input is the token sampled last; its row is what talker step t needs.
        rows, dtype = rows_to_wire(self.engine.reply_rows(embeds, output))
        token = np.array([self.stream.tokens[-1]], dtype=np.int64)
        self.job.emit(tensor_frame(REPLY_KIND, {"rows": rows, "token_ids": token}, dtype=dtype))
