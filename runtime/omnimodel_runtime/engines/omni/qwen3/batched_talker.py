"""The Qwen3-Omni talker batched across requests (``engine_args.batching``): :class:`BatchedTalker`.

Each request's prefill (the whole model's talker inputs, its first first-group code) runs through
``generate()`` as in the one-at-a-time path, as soon as the thinker has sent its prompt rows and its first
reply row; its cache then goes into a decode slot (:class:`~.slots.Qwen3SlotDecoder`). Every iteration, each
request whose next input is here takes one step together with the others:

- the **code predictor** draws the residual codes of every request's last first-group code in one batch
  (its ``num_code_groups - 1`` steps over a fresh cache of two positions: the talker's last hidden state
  and that code's embedding; every request has the same length, so no padding), each request sampling from
  its own random stream (``top_k`` 50, ``top_p`` 0.8, as the whole model's ``generate()`` asks for);
- that frame of ``num_code_groups`` codes goes to code2wav;
- the talker steps every request at once: its input is the sum of the frame's code embeddings plus the
  request's next text row (the thinker's next reply row through ``text_projection``, then ``tts_eos``, then
  ``tts_pad``, the whole model's ``trailing_text_hidden``), and each request samples its next first-group
  code from its logits with the whole model's processors (repetition penalty over its codes, the suppressed
  tail of the vocabulary, temperature, top-k, top-p).

The talker starts on the thinker's first reply row and consumes reply row ``t + 1`` at step ``t``, waiting
for it (sitting steps out) while the thinker has not produced it, so the two run side by side as in
Qwen2.5-Omni. The reply rows are projected one at a time as they arrive (the whole model projects the
assistant's text in one batch, which rounds differently; see docs/pipelines/qwen3-omni.md), so a request's
codes do not depend on what else was batched with it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers import (
    DynamicCache,
    RepetitionPenaltyLogitsProcessor,
    StoppingCriteriaList,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from omnimodel_runtime.engines.devices import sdpa_scope
from omnimodel_runtime.engines.omni.common import (
    CODES_KIND,
    PROMPT_KIND,
    REPLY_KIND,
    RngTurn,
    generate,
    rows_from_wire,
    tensor_frame,
)
from omnimodel_runtime.engines.omni.engine import OmniJob
from omnimodel_runtime.engines.omni.qwen3.slots import Qwen3SlotDecoder
from omnimodel_runtime.engines.omni.talker import draw
from omnimodel_runtime.engines.slots import SlotTable, host_ints
from omnimodel_runtime.engines.worker import CancelledRequestError
from omnimodel_runtime.protocol.stage import FinalFrame, ResponseFrame, TensorFrame, Usage

if TYPE_CHECKING:
    from omnimodel_runtime.engines.omni.qwen3.talker import Qwen3TalkerEngine

log = logging.getLogger(__name__)

# The whole model's code predictor sampling (its talker's prepare_inputs_for_generation asks for these).
PREDICTOR_TOP_K = 50
PREDICTOR_TOP_P = 0.8
# Generation parameters the batched talker applies (others are the one-at-a-time path's only).
BATCHED_KEYS = frozenset(
    {
        "max_new_tokens",
        "do_sample",
        "top_k",
        "top_p",
        "temperature",
        "repetition_penalty",
        "eos_token_id",
        "suppress_tokens",
    }
)


@dataclass(eq=False, kw_only=True)
class _Row:
    """A request of the batched talker: its thinker input so far and, once prefilled, its slot state."""

    job: OmniJob
    prompt: TensorFrame | None = None
    first: TensorFrame | None = None
    later: list[TensorFrame] = field(default_factory=list)  # reply rows that came before the prefill
    upstream_done: bool = False
    # Once prefilled:
    prefilled: bool = False
    trailing: list[torch.Tensor] = field(default_factory=list)  # projected reply rows after the first
    replies: int = 0  # reply rows received (the first one included)
    end_at: int | None = None  # the reply index of the first <|im_end|> (an ignore_eos reply)
    eos_row: torch.Tensor | None = None
    pad_row: torch.Tensor | None = None
    generator: torch.Generator | None = None
    length: int = 0  # positions cached
    delta: int = 0  # M-RoPE shift of the prompt's media
    step: int = 0  # decode steps taken (the whole model's generation_step)
    samples: int = 0  # first-group codes drawn (max_new_tokens counts these)
    limit: int = 0
    code: int = 0  # the last first-group code, not yet spoken
    history: list[int] = field(default_factory=list)  # every first-group code drawn (repetition penalty)
    hidden: torch.Tensor | None = None  # the talker's last final-normed hidden state
    count: int = 0  # frames spoken
    prompt_len: int = 0

    def text_row(self) -> torch.Tensor | None:
        """The text row of the next step (``trailing_text_hidden[step]`` or ``tts_pad``), ``None`` while the
        thinker has not sent it yet."""
        t = self.step
        assert self.eos_row is not None
        assert self.pad_row is not None
        if self.end_at is not None and t >= self.end_at:
            return self.eos_row if t == self.end_at else self.pad_row
        if t < len(self.trailing):
            return self.trailing[t]
        if not self.upstream_done:
            return None
        return self.eos_row if t == self.replies - 1 else self.pad_row


class BatchedTalker:
    """The batched serving of a :class:`Qwen3TalkerEngine` (its ``advance`` and ``release``)."""

    def __init__(self, engine: Qwen3TalkerEngine) -> None:
        self.engine = engine
        model = self.model = engine.model
        tc = engine.config.talker_config
        self.groups = int(tc.num_code_groups)
        self.im_end = int(engine.config.im_end_token_id)
        capacity = int(engine.args.get("slot_capacity", 8192))
        decoder = Qwen3SlotDecoder(
            model.model,
            model.codec_head,
            slots=engine.max_batch,
            capacity=capacity,
            graphs=engine.graphs,
            compiled=engine.compiled,
        )
        decoder.capture_all()
        self.slots = SlotTable(decoder)
        g = engine._generation
        unknown = set(g) - BATCHED_KEYS
        if unknown:
            log.warning("The batched talker ignores generation parameters %s", sorted(unknown))
        self.sample = bool(g.get("do_sample", False))
        self.eos = int(g["eos_token_id"])
        processors: list[Any] = []
        if g.get("repetition_penalty") not in (None, 1.0):
            processors.append(RepetitionPenaltyLogitsProcessor(float(g["repetition_penalty"])))
        if g.get("suppress_tokens"):
            processors.append(SuppressTokensLogitsProcessor(list(g["suppress_tokens"]), device=engine.device))
        if self.sample:
            processors.extend(_warpers(g.get("temperature"), g.get("top_k"), g.get("top_p")))
        self.processors = processors
        predictor = model.code_predictor.generation_config
        self.predictor_processors = _warpers(getattr(predictor, "temperature", None), PREDICTOR_TOP_K, PREDICTOR_TOP_P)

    # ------------------------------------------------------------ the engine's batched hooks

    def advance(self, jobs: list[OmniJob]) -> tuple[list[OmniJob], bool]:
        engine = self.engine
        finished: list[OmniJob] = []
        moved = False
        for job in jobs:
            row = job.state
            if row is None:
                row = job.state = _Row(job=job)
            with engine.alone(job, finished):
                self._take(row, job.poll())
                if not row.prefilled and row.first is not None and self.slots.free > 0:
                    moved = True
                    if self._prefill(row):
                        finished.append(job)
                elif not row.prefilled and row.first is None and row.upstream_done:
                    # The thinker stopped after one token: nothing to speak (the whole model needs two).
                    job.emit(FinalFrame("stop", Usage()))
                    finished.append(job)
        ready = [row for row in self.slots.holders if row.text_row() is not None]
        if ready:
            moved = True
            with engine.one_wake_up():
                done = self._decode(ready)
            for row in done:
                self.release(row.job)
            finished.extend(row.job for row in done)
        return finished, moved

    def release(self, job: OmniJob) -> None:
        row = job.state
        if isinstance(row, _Row) and row in self.slots.holders:
            self.slots.release(row, lambda r: int(r.length))

    # ------------------------------------------------------------ input

    def _take(self, row: _Row, frames: list[ResponseFrame]) -> None:
        for frame in frames:
            if isinstance(frame, TensorFrame) and frame.meta.get("kind") == PROMPT_KIND:
                row.prompt = frame
            elif isinstance(frame, TensorFrame) and frame.meta.get("kind") == REPLY_KIND:
                if row.first is None:
                    # The prefill takes the first reply row; any more in its frame wait for their steps.
                    row.first = _rows_slice(frame, 0, 1)
                    row.replies = 1
                    self._note_ends(row, frame, 0)
                    if len(frame.tensors["token_ids"]) > 1:
                        row.later.append(_rows_slice(frame, 1, None))
                elif not row.prefilled:
                    row.later.append(frame)
                else:
                    self._reply(row, frame)
            elif isinstance(frame, FinalFrame):
                row.upstream_done = True
        if row.job.ended:
            row.upstream_done = True

    def _note_ends(self, row: _Row, frame: TensorFrame, first_index: int) -> None:
        if row.end_at is None:
            for k, token in enumerate(np.asarray(frame.tensors["token_ids"]).tolist()):
                if int(token) == self.im_end:
                    row.end_at = first_index + k
                    break

    def _reply(self, row: _Row, frame: TensorFrame) -> None:
        """Reply rows after the first: each projected alone (``text_projection``), kept until its step."""
        dtype = str(frame.meta.get("dtype", "float32"))
        rows = rows_from_wire(frame.tensors["rows"], dtype, self.engine.device).to(self.model.dtype)
        self._note_ends(row, frame, row.replies)
        for k in range(rows.shape[0]):
            row.trailing.append(self.model.text_projection(rows[k : k + 1])[0])
        row.replies += int(rows.shape[0])

    # ------------------------------------------------------------ prefill

    def _prefill(self, row: _Row) -> bool:
        """The whole model's talker prefill and first code through ``generate()``, then its cache into a
        slot. True when the request finished there."""
        from omnimodel_runtime.engines.omni.qwen3.talker import _Stop  # noqa: PLC0415  (a cycle otherwise)

        engine, model, job = self.engine, self.model, row.job
        assert row.prompt is not None
        assert row.first is not None
        inputs = engine.inputs(row.prompt, [row.first])
        generation = engine.generation_for(job)
        row.limit = int(generation["max_new_tokens"])
        turn = RngTurn(engine.device, job.data["seed"])
        criterion = _Stop(engine, job, turn, eos=self.eos)
        hook = model.register_forward_hook(lambda *_: turn.begin())
        try:
            with sdpa_scope(engine.prefill_attention):
                out = generate(
                    model,
                    **inputs,
                    stopping_criteria=StoppingCriteriaList([criterion]),
                    output_hidden_states=True,
                    return_dict_in_generate=True,
                    **{**generation, "max_new_tokens": 1},
                )
        finally:
            hook.remove()
            turn.end()
        row.prefilled = True
        row.prompt_len = int(inputs["inputs_embeds"].shape[1])
        row.code = int(out.sequences[0, -1])
        row.samples, row.history = 1, [row.code]
        # The whole model's tts_eos (trailing_text_hidden's last row for a one-token reply) and tts_pad.
        row.eos_row, row.pad_row = inputs["trailing_text_hidden"][0, -1], inputs["tts_pad_embed"][0, 0]
        if row.code == self.eos or row.limit <= 1:
            self._finish(row, "stop" if row.code == self.eos else "length")
            return True
        # The step's hidden states (per layer, the last one final-normed), last position.
        row.hidden = out.hidden_states[0][0][-1][0, -1].clone()
        row.generator = turn.generator()
        row.length = row.prompt_len
        deltas = getattr(model, "rope_deltas", None)
        row.delta = int(deltas.reshape(-1)[0]) if isinstance(deltas, torch.Tensor) else 0
        slot = self.slots.take(row)
        self.slots.decoder.load(slot, out.past_key_values, row.length)
        for frame in row.later:
            self._reply(row, frame)
        row.later.clear()
        return False

    # ------------------------------------------------------------ decode

    def _decode(self, rows: list[_Row]) -> list[_Row]:
        """One step of every row of ``rows`` (their next text row is here): residual codes, their frame out,
        one talker step, the next first-group codes. Returns the rows that ended."""
        engine, model, device = self.engine, self.model, self.engine.device
        done: list[_Row] = []
        live: list[_Row] = []
        for row in rows:
            if row.samples >= row.limit or row.length + 1 >= self.slots.decoder.capacity:
                self._finish(row, "length")
                done.append(row)
            else:
                live.append(row)
        if not live:
            return done
        codes = host_ints([r.code for r in live], device).unsqueeze(1)  # (rows, 1)
        code_embeds = model.get_input_embeddings()(codes)  # (rows, 1, hidden)
        hidden_rows: list[torch.Tensor] = []
        text_rows: list[torch.Tensor] = []
        for row in live:
            text_row = row.text_row()
            assert row.hidden is not None
            assert text_row is not None
            hidden_rows.append(row.hidden)
            text_rows.append(text_row)
        hidden = torch.stack(hidden_rows).unsqueeze(1)
        residual, embeds = self._predict(live, torch.cat((hidden, code_embeds), dim=1))
        frames = torch.cat((codes, residual), dim=1).to("cpu").numpy()
        x = torch.cat((code_embeds, *embeds), dim=1).sum(1) + torch.stack(text_rows)
        engine.context.metrics.observe_batch(len(live))
        # A step runs the first n slots: every holder, in slot order. Rows not stepping now (waiting for the
        # thinker) run with a zero input: the step only rewrites their next position, which their own step
        # writes again before anything reads it (see engines/slots.py).
        holders: list[_Row] = list(self.slots.holders)
        slot_of = {id(row): i for i, row in enumerate(holders)}
        at = host_ints([slot_of[id(row)] for row in live], device)
        inputs = torch.zeros((len(holders), x.shape[-1]), dtype=x.dtype, device=device).index_copy_(0, at, x)
        lengths = [r.length for r in holders]
        all_hidden, all_logits = self.slots.decoder.step(inputs, lengths, [r.length + r.delta for r in holders])
        out_hidden, logits = all_hidden.index_select(0, at), all_logits.index_select(0, at)
        width = max(len(r.history) for r in live)
        history = host_ints([h for r in live for h in (r.history + [r.history[0]] * (width - len(r.history)))], device)
        scores = logits.view(len(live), -1)
        for processor in self.processors:
            scores = processor(history.view(len(live), width), scores)
        if self.sample:
            picks, _ = draw(torch.softmax(scores, dim=-1), [r.generator for r in live])  # type: ignore[misc]
        else:
            picks = scores.argmax(dim=-1)
        picked: list[int] = picks.tolist()
        for k, row in enumerate(live):
            row.hidden = out_hidden[k].clone()
            row.length += 1
            row.step += 1
            row.count += 1
            engine.context.metrics.add_generated_tokens(1)
            row.job.emit(tensor_frame(CODES_KIND, {"codes": frames[k]}))
            row.code = picked[k]
            row.samples += 1
            row.history.append(row.code)
            try:
                if row.code == self.eos:
                    self._finish(row, "stop")
                elif row.samples >= row.limit:
                    self._finish(row, "length")
                else:
                    row.job.check()
                    continue
            except CancelledRequestError:
                pass
            done.append(row)
        return done

    def _predict(self, rows: list[_Row], inputs: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The code predictor's residual codes of every row (``inputs``: (rows, 2, hidden), the talker's last
        hidden state and the last first-group code's embedding) and their embeddings, as the whole model sums
        them (each residual code through the code predictor's embedding of its group)."""
        predictor = self.model.code_predictor
        embeddings = predictor.get_input_embeddings()
        generators = [r.generator for r in rows]
        cache = DynamicCache(config=predictor.config)
        codes: list[torch.Tensor] = []
        embeds: list[torch.Tensor] = []
        out = predictor(inputs_embeds=inputs, past_key_values=cache, use_cache=True)
        for group in range(1, self.groups):
            scores = out.logits[:, -1, :].float()
            if self.sample:
                for processor in self.predictor_processors:
                    scores = processor(None, scores)
                pick, _ = draw(torch.softmax(scores, dim=-1), generators)  # type: ignore[arg-type]
            else:
                pick = scores.argmax(dim=-1)
            code = pick.unsqueeze(1)
            codes.append(code)
            embeds.append(embeddings[group - 1](code))
            if group < self.groups - 1:
                out = predictor(input_ids=code, past_key_values=cache, use_cache=True, generation_steps=group)
        return torch.cat(codes, dim=1), embeds

    def _finish(self, row: _Row, reason: str) -> None:
        row.job.emit(FinalFrame(reason, Usage(prompt_tokens=row.prompt_len, completion_tokens=row.count)))


def _warpers(temperature: Any, top_k: Any, top_p: Any) -> list[Any]:
    """``generate()``'s sampling warpers, in its order (temperature, top-k, top-p), for the values it applies."""
    out: list[Any] = []
    if temperature not in (None, 1.0):
        out.append(TemperatureLogitsWarper(float(temperature)))
    if top_k:
        out.append(TopKLogitsWarper(int(top_k)))
    if top_p not in (None, 1.0):
        out.append(TopPLogitsWarper(float(top_p)))
    return out


def _rows_slice(frame: TensorFrame, lo: int, hi: int | None) -> TensorFrame:
    """Reply rows ``[lo, hi)`` of a reply frame, as a frame of their own."""
    tensors = {name: np.asarray(frame.tensors[name])[lo:hi] for name in ("rows", "token_ids")}
    return TensorFrame(tensors=tensors, meta=dict(frame.meta))
