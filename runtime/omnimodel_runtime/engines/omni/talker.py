"""The Qwen2.5-Omni talker stage: thinker rows in, codec codes out, as they are sampled.

Runs ``Qwen2_5OmniTalkerForConditionalGeneration.generate()`` with the arguments the whole model's
``generate()`` builds, so the codes are the whole model's codes. The one difference is when its input
exists: the whole model hands over every reply row at once, after the thinker has finished; here a forward
pre-hook supplies each decode step with the row it consumes (the talker uses row t at step t, then the
text-end row, then the text-pad row for as long as it keeps speaking), waiting for it if the thinker has
not produced it yet. So the talker starts on the thinker's first token and the two run side by side.

Sampling uses the request's own random stream (:class:`~omnimodel_runtime.engines.omni.common.RngTurn`,
seeded like the whole model: ``torch.manual_seed(seed)`` before ``generate()``); its final state goes to
code2wav, whose diffusion noise continues the same stream, as it does in the whole model.

This module is the engine: loading, requests one at a time through ``generate()``, and batched serving over
decode slots (one step queued ahead of the host). What goes into and out of ``generate()`` is
:mod:`~omnimodel_runtime.engines.omni.talker_stream`; the batched path's rows, steps and sampling are
:mod:`~omnimodel_runtime.engines.omni.talker_batch`.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from transformers import (
    Qwen2_5OmniTalkerForConditionalGeneration,
    RepetitionPenaltyLogitsProcessor,
    StoppingCriteriaList,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from omnimodel_runtime.engines.base import flag
from omnimodel_runtime.engines.devices import sdpa_scope
from omnimodel_runtime.engines.omni.common import (
    AUDIO_LENGTHS,
    IMAGE_GRID,
    PROMPT_KIND,
    REPLY_KIND,
    RNG_KIND,
    USE_AUDIO_IN_VIDEO,
    VIDEO_GRID,
    VIDEO_SECONDS,
    RngTurn,
    generate,
    generation_overrides,
    load_config,
    load_part,
    request_seed,
    rows_from_wire,
    rows_to_wire,
    tensor_frame,
)
from omnimodel_runtime.engines.omni.engine import OmniEngine, OmniJob
from omnimodel_runtime.engines.omni.talker_batch import _BATCHED_KEYS, _Step, _TalkerRow, draw
from omnimodel_runtime.engines.omni.talker_stream import _Call, _Codes, _head, _reply_rows, _ReplyRows
from omnimodel_runtime.engines.slots import SlotDecoder, SlotTable, host_ints, supported
from omnimodel_runtime.engines.worker import CancelledRequestError
from omnimodel_runtime.errors import StageError
from omnimodel_runtime.protocol.stage import (
    FinalFrame,
    StageInput,
    StageParams,
    TensorFrame,
    Usage,
)

# What goes into and out of generate(), and the batched path's parts, have modules of their own; every name
# that lived here stays importable from here (other engine families build on them).
__all__ = [
    "TALKER_DEFAULTS",
    "_BATCHED_KEYS",
    "OmniTalkerEngine",
    "_Call",
    "_Codes",
    "_ReplyRows",
    "_Step",
    "_TalkerRow",
    "_head",
    "_reply_rows",
    "draw",
    "warm_up_talker",
]

log = logging.getLogger(__name__)

# The whole model's generate() defaults for its talker (eos/pad come from the talker config).
TALKER_DEFAULTS: dict[str, Any] = {
    "max_new_tokens": 4096,
    "do_sample": True,
    "top_k": 40,
    "top_p": 0.8,
    "temperature": 0.9,
    "repetition_penalty": 1.05,
}


async def warm_up_talker(engine: OmniEngine, prompt: TensorFrame) -> None:
    """Warm a talker up on ``prompt`` (made-up rows will do) and one reply row, for two codes: every
    module of a request's path runs once, prefill and decode."""
    reply = {"rows": prompt.tensors["prompt_rows"][:1], "token_ids": np.zeros(1, dtype=np.int64)}
    frames = [prompt, tensor_frame(REPLY_KIND, reply, dtype=prompt.meta["dtype"])]
    await engine.warm_up_on(frames, StageParams(talker_max_new_tokens=2))


class OmniTalkerEngine(OmniEngine):
    """``transformers`` adapter for the ``omni-talker`` task."""

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        self.model: Any = None
        self._generation: dict[str, Any] = dict(TALKER_DEFAULTS)
        self._eos: list[int] = []
        self._slots: SlotTable | None = None  # batched serving: the decode slots
        self._ids = torch.zeros(0, dtype=torch.long)
        self._codes = torch.zeros(0, dtype=torch.long)  # batched serving: each slot's last code, on the device
        self._pending: _Step | None = None  # the step queued last, its codes not yet read
        self._steps = 0
        self._ahead = True  # engine_args.decode_ahead
        self._processors: list[Any] = []
        self._sample = True
        self._stream_priority = -1  # ahead of code2wav's DiT passes on a shared GPU

    def load_part(self) -> None:
        model_dir = self.context.model_dir
        config = load_config(model_dir)
        self.model = load_part(
            Qwen2_5OmniTalkerForConditionalGeneration,
            model_dir,
            config.talker_config,
            dtype=self.dtype,
            device=self.device,
        )
        # The whole model ends speech on codec pad or end ([8292, 8294] in the released vocabulary).
        self._eos = [self.model.codec_pad_token, self.model.codec_eos_token]
        self._generation.update(generation_overrides(model_dir, "talker", self.args))
        self._generation.setdefault("eos_token_id", self._eos)
        if self.batched:
            self._load_slots()

    async def warmup(self) -> None:
        rows, dtype = rows_to_wire(torch.zeros((2, int(self.model.config.embedding_size)), dtype=self.model.dtype))
        tensors = {"prompt_rows": rows, "prompt_ids": np.zeros(2, dtype=np.int64), "special_rows": rows[[0, 1, 0]]}
        await warm_up_talker(self, tensor_frame(PROMPT_KIND, tensors, dtype=dtype, speaker_bos_token=0))

    def prepare(self, inp: StageInput, job: OmniJob) -> None:
        if inp.upstream is None:
            raise StageError("the talker takes its input from the thinker stage", status=400)
        job.data["seed"] = request_seed(inp.request)

    def run(self, job: OmniJob) -> None:
        frames = job.upstream()
        prompt, first = _head(frames)
        turn = RngTurn(self.device, job.data["seed"])
        if prompt is None or first is None:
            # The thinker stopped after one token: there is no reply to speak (the whole model needs two).
            self._finish(job, turn.state, codes=0, prompt_len=0)
            return
        call = self._call(job, prompt, first, turn)
        source = _ReplyRows(_reply_rows(frames, call.rows, call.rest), end=call.end, pad=call.pad)

        def supply(module: Any, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
            if kwargs.get("inputs_embeds") is None:  # a decode step (the prefill takes the prompt rows)
                kwargs["thinker_reply_part"] = source.next().reshape(1, 1, -1)
            return args, kwargs

        hook = self.model.register_forward_pre_hook(supply, with_kwargs=True)
        try:
            self._generate(call, turn)
        finally:
            hook.remove()
        self._finish(
            job, turn.state, codes=call.criterion.count, prompt_len=call.prompt_len, reason=call.criterion.reason
        )

    def _call(self, job: OmniJob, prompt: TensorFrame, first: TensorFrame, turn: RngTurn) -> _Call:
        """The whole model's talker inputs for ``job``: prompt rows, the speaker's bos row, the first reply
        row (and the rows the reply continues with)."""
        param_dtype = self.model.dtype
        dtype = str(prompt.meta.get("dtype", "float32"))

        def rows(frame: TensorFrame, name: str) -> torch.Tensor:
            return rows_from_wire(frame.tensors[name], dtype, self.device).to(param_dtype)

        prompt_rows, special, reply0 = rows(prompt, "prompt_rows"), rows(prompt, "special_rows"), rows(first, "rows")
        prompt_ids = torch.from_numpy(np.array(prompt.tensors["prompt_ids"], dtype=np.int64)).to(self.device)
        n = prompt_ids.shape[0]
        speaker_bos = int(prompt.meta["speaker_bos_token"])
        first_token = int(first.tensors["token_ids"][0])
        model = self.model
        inputs_embeds = torch.cat([prompt_rows, special[:1], reply0[:1]], dim=0).unsqueeze(0)
        input_ids = torch.cat(
            [
                torch.full((n,), model.codec_mask_token, dtype=torch.long, device=self.device),
                torch.tensor([model.codec_pad_token, model.codec_bos_token], dtype=torch.long, device=self.device),
            ]
        ).unsqueeze(0)
        text_ids = torch.cat(
            [prompt_ids, torch.tensor([speaker_bos, first_token], dtype=torch.long, device=self.device)]
        ).unsqueeze(0)
        generation = dict(self._generation)
        cap = job.request.params.talker_max_new_tokens
        if cap is not None:
            generation["max_new_tokens"] = min(cap, int(generation["max_new_tokens"]))
        criterion = _Codes(
            self, job, turn, eos=set(generation["eos_token_id"]), limit=int(generation["max_new_tokens"])
        )
        media: dict[str, Any] = {
            name: torch.from_numpy(np.array(prompt.tensors[name], dtype=np.int64)).to(self.device)
            for name in (AUDIO_LENGTHS, IMAGE_GRID, VIDEO_GRID)
            if name in prompt.tensors
        }
        if VIDEO_SECONDS in prompt.tensors:
            seconds = np.array(prompt.tensors[VIDEO_SECONDS], dtype=np.float32)
            media[VIDEO_SECONDS] = torch.from_numpy(seconds).to(self.device)
        media[USE_AUDIO_IN_VIDEO] = bool(prompt.meta.get(USE_AUDIO_IN_VIDEO, False))
        return _Call(
            media=media,
            input_ids=input_ids,
            text_ids=text_ids,
            inputs_embeds=inputs_embeds,
            reply0=reply0,
            rest=reply0[1:],
            end=special[1:2],
            pad=special[2:3],
            rows=rows,
            generation=generation,
            criterion=criterion,
        )

    def _generate(self, call: _Call, turn: RngTurn, **extra: Any) -> Any:
        model = self.model
        hook = model.register_forward_hook(lambda *_: turn.begin())
        try:
            with sdpa_scope(self.prefill_attention):
                return generate(
                    model,
                    input_ids=call.input_ids,
                    input_text_ids=call.text_ids,
                    # Replaced step by step by `supply`; generate() only needs the argument to exist.
                    thinker_reply_part=torch.zeros_like(call.reply0[:1]).unsqueeze(0),
                    inputs_embeds=call.inputs_embeds,
                    attention_mask=torch.ones((1, call.prompt_len), dtype=torch.long, device=self.device),
                    suppress_tokens=[model.codec_bos_token],
                    pad_token_id=model.codec_pad_token,
                    stopping_criteria=StoppingCriteriaList([call.criterion]),
                    **call.media,
                    **{**call.generation, **extra},
                )
        finally:
            hook.remove()
            turn.end()

    def _finish(self, job: OmniJob, state: torch.Tensor, *, codes: int, prompt_len: int, reason: str = "stop") -> None:
        job.emit(tensor_frame(RNG_KIND, {"rng_state": state.to("cpu").numpy()}, device=torch.device(self.device).type))
        job.emit(FinalFrame(reason, Usage(prompt_tokens=prompt_len, completion_tokens=codes)))

    # ------------------------------------------------------------ batched serving

    def _load_slots(self) -> None:
        problem = supported(self.model.model)
        if problem is not None:
            log.warning("The talker serves one request at a time: %s", problem)
            self.batched = False
            return
        capacity = int(self.args.get("slot_capacity", 8192))
        decoder = SlotDecoder(
            self.model.model,
            self.model.codec_head,
            slots=self.max_batch,
            capacity=capacity,
            graphs=self.graphs,
            compiled=self.compiled,
        )
        decoder.capture_all()
        self._slots = SlotTable(decoder)
        self._ahead = flag(self.args, "decode_ahead", default=True)
        # Each slot's token history (for the repetition penalty), padded with its own first token: a
        # repeated id changes nothing, so rows of different lengths are penalised as one batch.
        self._ids = torch.zeros((self.max_batch, decoder.capacity), dtype=torch.long, device=self.device)
        self._codes = torch.zeros(self.max_batch, dtype=torch.long, device=self.device)
        g = self._generation
        unknown = set(g) - _BATCHED_KEYS
        if unknown:
            log.warning("The batched talker ignores generation parameters %s", sorted(unknown))
        processors: list[Any] = []
        if g.get("repetition_penalty") not in (None, 1.0):
            processors.append(RepetitionPenaltyLogitsProcessor(float(g["repetition_penalty"])))
        processors.append(SuppressTokensLogitsProcessor([self.model.codec_bos_token], device=self.device))
        self._sample = bool(g.get("do_sample", False))
        if self._sample:
            if g.get("temperature") not in (None, 1.0):
                processors.append(TemperatureLogitsWarper(float(g["temperature"])))
            if g.get("top_k"):
                processors.append(TopKLogitsWarper(int(g["top_k"])))
            if g.get("top_p") not in (None, 1.0):
                processors.append(TopPLogitsWarper(float(g["top_p"])))
        # Called one by one in _decode: LogitsProcessorList.__call__ inspects each processor's signature
        # on every call, ~0.4 ms of each step's host time with these five on the H200's host (profiled).
        self._processors = processors

    def advance(self, jobs: list[OmniJob]) -> tuple[list[OmniJob], bool]:
        assert self._slots is not None
        finished: list[OmniJob] = []
        moved = False
        for job in jobs:
            row = job.state
            if row is None:
                row = job.state = _TalkerRow(job=job)
            with self.alone(job, finished):
                row.take(job.poll())
                if row.call is None and row.first is not None and self._slots.free > 0:
                    moved = True
                    if self._prefill(row):
                        finished.append(job)
                elif row.call is None and row.first is None and row.upstream_done:
                    # The thinker stopped after one token: nothing to speak.
                    self._finish(job, RngTurn(self.device, job.data["seed"]).state, codes=0, prompt_len=0)
                    finished.append(job)
        rows: list[_TalkerRow] = list(self._slots.holders)
        if self._pending is not None or any(r.launchable for r in rows):
            moved = True
            with self.one_wake_up():
                finished.extend(self._decode(rows))
        return finished, moved

    def _prefill(self, row: _TalkerRow) -> bool:
        """The whole model's prefill and first code through ``generate()``, then the cache into a slot."""
        assert self._slots is not None
        assert row.prompt is not None
        assert row.first is not None
        job = row.job
        turn = RngTurn(self.device, job.data["seed"])
        call = self._call(job, row.prompt, row.first, turn)
        out = self._generate(call, turn, max_new_tokens=1, return_dict_in_generate=True)
        row.call, row.generator = call, turn.generator()
        row.rows.extend(call.rest)
        for frame in row.later:
            row.rows.extend(call.rows(frame, "rows"))
        row.later.clear()
        if call.criterion.done:
            self._finish(
                job, turn.state, codes=call.criterion.count, prompt_len=call.prompt_len, reason=call.criterion.reason
            )
            return True
        row.length = call.prompt_len
        deltas = getattr(self.model, "rope_deltas", None)
        row.delta = int(deltas.reshape(-1)[0]) if isinstance(deltas, torch.Tensor) else 0
        slot = self._slots.take(row)
        self._slots.decoder.load(slot, out.past_key_values, row.length)
        self._codes[slot].copy_(out.sequences[0, -1])
        history = out.sequences[0]
        self._ids[slot].fill_(int(history[0]))
        self._ids[slot, : history.shape[0]].copy_(history)
        row.history = int(history.shape[0])
        return False

    def _decode(self, rows: list[_TalkerRow]) -> list[OmniJob]:
        """One batched decode step launched (rows still waiting for the thinker sit it out), then the
        codes of the step before read and streamed: the host reads a step behind, so the GPU runs this
        step while the host streams the last one's codes (reading them at once would wait for the GPU
        every step, ~1.8 ms of each ~4 ms step on the H200, profiled)."""
        launched = self._launch(rows)
        pending, self._pending = self._pending, None
        done = self._collect(pending) if pending is not None else []
        if launched is not None and self._ahead:
            self._pending = launched
        elif launched is not None:
            done.extend(self._collect(launched))
        for row in done:
            self.release(row.job)
        return [row.job for row in done]

    def _launch(self, rows: list[_TalkerRow]) -> _Step | None:
        """Queue the step for each launchable row: it consumes its last code (on the device) and its next
        reply row (or the text-end/-pad tail), and samples its next code into the device's code table. Nothing
        here waits for the device."""
        assert self._slots is not None
        model = self.model
        ready = [i for i, r in enumerate(rows) if r.launchable]
        if not ready:
            return None
        self._steps += 1
        inputs = torch.zeros((len(rows), int(model.config.embedding_size)), dtype=model.dtype, device=self.device)
        picked = host_ints(ready, self.device)
        inputs.index_copy_(0, picked, torch.stack([rows[i].next_row() for i in ready]))
        codes = self._codes[: len(rows)]
        x = model.thinker_to_talker_proj(model.get_input_embeddings()(codes) + inputs)
        _, logits = self._slots.decoder.step(x, [r.length for r in rows], [r.length + r.delta for r in rows])
        scores = logits.index_select(0, picked)
        width = max(rows[i].history for i in ready)
        history = self._ids.index_select(0, picked)[:, :width]
        for processor in self._processors:  # what LogitsProcessorList does with two-argument processors
            scores = processor(history, scores)
        if self._sample:
            generators = [rows[i].generator for i in ready]
            picks, before = draw(torch.softmax(scores, dim=-1), generators)  # type: ignore[arg-type]
            for i, state in zip(ready, before, strict=True):
                rows[i].before = state
        else:
            picks = scores.argmax(dim=-1)
        self._codes.index_copy_(0, picked, picks)
        capacity = self._slots.decoder.capacity
        at = [k for k, i in enumerate(ready) if rows[i].history < capacity]
        if at:
            where = host_ints([rows[ready[k]].history for k in at], self.device)
            slots = picked if len(at) == len(ready) else host_ints([ready[k] for k in at], self.device)
            values = picks if len(at) == len(ready) else picks.index_select(0, host_ints(at, self.device))
            self._ids.index_put_((slots, where), values)
        step = _Step(number=self._steps, rows=[rows[i] for i in ready], codes=picks, event=None)
        if torch.device(self.device).type == "cuda":
            step.codes = picks.to("cpu", non_blocking=True)  # into pinned memory, read when the event is done
            step.event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            step.event.record()
        self.context.metrics.observe_batch(len(ready))
        for row in step.rows:
            assert row.call is not None
            row.length += 1
            row.steps += 1
            row.launched = self._steps
            if row.history < capacity:
                row.history += 1
            # Its last step is queued once the next position would not fit or the code cap is reached
            # (the prefill sampled one code, each step one more).
            row.final = row.length + 1 >= capacity or 1 + row.steps >= row.call.criterion.limit
        return step

    def _collect(self, step: _Step) -> list[_TalkerRow]:
        """Stream the codes ``step`` sampled (waiting for the step if it is still running); the rows whose
        speech ended there."""
        assert self._slots is not None
        if step.event is not None:
            step.event.synchronize()
        picks: list[int] = step.codes.tolist()
        done: list[_TalkerRow] = []
        holders = set(map(id, self._slots.holders))
        for row, code in zip(step.rows, picks, strict=True):
            if id(row) not in holders or row.over:
                continue  # released (cancelled, failed) or ended on an earlier step: this code is not spoken
            assert row.call is not None
            try:
                stop = row.call.criterion.take(code)
            except CancelledRequestError:
                row.over = True
                done.append(row)
                continue
            except Exception as err:
                self.fail(row.job, err)
                row.over = True
                done.append(row)
                continue
            if not stop and row.final and row.launched == step.number:  # its last step (the cap ends it itself)
                row.call.criterion.reason, stop = "length", True
            if stop:
                assert row.generator is not None
                # A step queued after this one drew from the generator: report the state before that draw.
                state = row.before if self._sample and row.launched > step.number else row.generator.get_state()
                assert state is not None
                self._finish(
                    row.job,
                    state,
                    codes=row.call.criterion.count,
                    prompt_len=row.call.prompt_len,
                    reason=row.call.criterion.reason,
                )
                row.over = True
                done.append(row)
        return done

    def release(self, job: OmniJob) -> None:
        row = job.state
        if self._slots is None or not isinstance(row, _TalkerRow) or row not in self._slots.holders:
            return
        last = len(self._slots.holders) - 1
        moved = self._slots.release(row, lambda r: int(r.length))
        for slot in moved.values():
            self._ids[slot].copy_(self._ids[last])
            self._codes[slot].copy_(self._codes[last])
        if not self._slots.holders:
            self._pending = None
