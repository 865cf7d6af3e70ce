"""Causal-LM text generation on Hugging Face ``transformers`` with continuous batching.

All model work runs on the engine's worker thread (:class:`~omnimodel_runtime.engines.worker.WorkerEngine`);
the event loop only renders prompts, submits them, and relays the frames the worker posts back.

The worker keeps one running batch: a left-padded KV cache (``DynamicCache``), a 2-D attention mask and
per-row positions. Every iteration it

1. takes newly arrived requests (when idle it blocks for the first one, then waits up to
   ``batch_wait`` for more, so a burst of concurrent requests starts as one batch),
2. prefills them together (left-padded) and merges their cache into the running batch by left-padding
   the shorter of the two,
3. runs one decode step for every active row, samples each row with its own parameters and generator,
   and streams each row's token delta to its request,
4. drops finished, cancelled or expired rows (``batch_select_indices``) and trims cache columns that no
   remaining row attends to.

So requests join and leave between steps: a long generation does not hold back a short one that
arrives later, and N concurrent requests cost roughly one forward pass per step instead of N.

``engine_args.decode: static`` (the default on CUDA) keeps the same loop on a static cache instead: each
request's prompt is prefilled by the model as usual (new requests together, left-padded), its cache is
copied into a slot of :class:`~omnimodel_runtime.engines.slots.SlotDecoder`, and every decode step runs
over the slots as one captured CUDA graph (captured at start for every batch and length bucket), so a
step costs one launch instead of ~10 µs per eager op; ``decode_compile`` (default: on CUDA) compiles the
step's layers with ``torch.compile`` before the capture. ``dynamic`` (the default elsewhere) is the loop above.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.utils import logging as hf_logging

from omnimodel_runtime.engines.base import EngineContext, flag
from omnimodel_runtime.engines.compat import cache_kwargs
from omnimodel_runtime.engines.devices import resolve_device, torch_dtype
from omnimodel_runtime.engines.slots import SlotDecoder, SlotTable, supported
from omnimodel_runtime.engines.text.common import (
    GenerationDefaults,
    IncrementalDetokenizer,
    ResolvedSampling,
    render_prompt,
    resolve_sampling,
)
from omnimodel_runtime.engines.worker import Job, WorkerEngine
from omnimodel_runtime.protocol.stage import (
    FinalFrame,
    ResponseFrame,
    SamplingParams,
    StageInput,
    StageRequest,
    TextFrame,
    Usage,
)

log = logging.getLogger(__name__)


@dataclass(eq=False, kw_only=True)
class _Seq(Job):
    """One request inside the worker; everything but ``cancelled`` belongs to the worker thread."""

    prompt_ids: list[int]
    sampling: ResolvedSampling
    detok: IncrementalDetokenizer
    generator: torch.Generator | None
    generated: int = 0
    last_token: int = 0
    tokens: list[int] = field(default_factory=list)
    length: int = 0  # static decode: positions in the request's slot


@dataclass
class _Batch:
    rows: list[_Seq]
    cache: DynamicCache
    mask: torch.Tensor  # (rows, cached columns), 1 where a row attends
    next_pos: torch.Tensor  # (rows,), position id of each row's next input token


class TransformersTextEngine(WorkerEngine[_Seq]):
    """``transformers`` adapter for the ``text-generation`` task."""

    def __init__(self, context: EngineContext) -> None:
        super().__init__(context)
        args = dict(context.stage.engine_args)
        self._device = resolve_device(context.settings.device)
        self._dtype = torch_dtype(args.get("dtype"), self._device)
        self._max_batch = int(args.get("max_batch_size", context.settings.max_batch_size))
        self._batch_wait = float(args.get("batch_wait", context.settings.batch_wait))
        self._max_model_len_arg = args.get("max_model_len")
        decode = str(args.get("decode", "static" if torch.device(self._device).type == "cuda" else "dynamic"))
        if decode not in ("static", "dynamic"):
            raise ValueError(f"engine_args.decode must be static or dynamic, not {decode!r}")
        self._static = decode == "static"
        self._graphs = flag(args, "cuda_graphs", default=True)
        # The slot step's layers compiled before capture (slots.py), by default where graphs are captured.
        on_cuda = torch.device(self._device).type == "cuda"
        self._compiled = flag(args, "decode_compile", default=on_cuda)
        self._capacity = int(args.get("slot_capacity", 4096))
        self._slots: SlotTable | None = None
        self._model: Any = None
        # Two instances of the same tokenizer: the event loop renders prompts while the worker
        # detokenizes, and a Rust tokenizer shared across threads can fail with "Already borrowed".
        self._tokenizer: Any = None
        self._detok_tokenizer: Any = None
        self._defaults = GenerationDefaults()
        self._max_model_len = 0
        self._vocab_size = 0
        self._pad_id = 0

    # ------------------------------------------------------------------ event loop side

    async def warmup(self) -> None:
        request = StageRequest(
            request_id=f"warmup-{secrets.token_hex(4)}",
            prompt="Warm up.",
            sampling=SamplingParams(max_tokens=2, temperature=0.0),
        )
        async for _ in self.generate(StageInput(request=request)):
            pass

    @property
    def max_model_len(self) -> int | None:
        return self._max_model_len or None

    async def generate(self, inp: StageInput) -> AsyncIterator[ResponseFrame]:
        self.require_running()
        request = inp.request
        prompt_ids = render_prompt(self._tokenizer, request, vocab_size=self._vocab_size)
        sampling = resolve_sampling(
            request, self._defaults, prompt_len=len(prompt_ids), max_model_len=self._max_model_len
        )
        generator = None
        if not sampling.greedy:
            generator = torch.Generator()
            generator.manual_seed(sampling.seed if sampling.seed is not None else secrets.randbits(63))
        seq = _Seq(
            request=request,
            prompt_ids=prompt_ids,
            sampling=sampling,
            detok=IncrementalDetokenizer(self._detok_tokenizer, sampling.stop),
            generator=generator,
        )
        # Closed explicitly, so that a caller going away cancels the row at once (not at garbage collection).
        async with contextlib.aclosing(self.stream(seq, merge_text=True)) as frames:
            async for frame in frames:
                yield frame

    # ------------------------------------------------------------------ worker thread

    def worker_mode(self) -> contextlib.AbstractContextManager[Any]:
        return torch.inference_mode()

    def load(self) -> None:
        model_dir = self.context.model_dir
        # Progress bars are noise in pod logs.
        hf_logging.disable_progress_bar()
        self._tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self._detok_tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=self._dtype)
        self._model = model.to(self._device).eval()
        self._defaults = GenerationDefaults.from_model_dir(model_dir)
        config_len = getattr(model.config, "max_position_embeddings", None) or 2048
        self._max_model_len = int(self._max_model_len_arg or config_len)
        # Rows of the embedding table: the ids a forward pass can take (the tokenizer may know fewer).
        self._vocab_size = int(model.get_input_embeddings().num_embeddings)
        pad = self._tokenizer.pad_token_id
        if pad is None:
            pad = next(iter(self._defaults.eos_token_ids), 0)
        self._pad_id = int(pad)
        if self._static:
            problem = supported(getattr(self._model, "model", None))
            if problem is not None:
                log.warning("Decoding with a dynamic cache: %s", problem)
                self._static = False
        if self._static:
            self._max_model_len = min(self._max_model_len, self._capacity)
            decoder = SlotDecoder(
                self._model.model,
                self._model.lm_head,
                slots=self._max_batch,
                capacity=self._max_model_len,
                graphs=self._graphs,
                compiled=self._compiled,
            )
            decoder.capture_all()
            self._slots = SlotTable(decoder)
        log.info(
            "Loaded %s on %s (%s) for stage %s, %s decode",
            model_dir,
            self._device,
            self._dtype,
            self.stage.name,
            "static" if self._static else "dynamic",
        )

    def serve(self) -> None:
        if self._static:
            self._serve_static()
            return
        batch: _Batch | None = None
        while True:
            self.flush()
            room = self._max_batch - (len(batch.rows) if batch else 0)
            # Idle: wait for a request, then up to batch_wait for a burst to start as one batch.
            idle = batch is None
            new = self.gather(room, block=idle, wait=self._batch_wait if idle else 0.0)
            if self.stopping:
                for seq in [*new, *(batch.rows if batch else [])]:
                    self.refuse(seq)
                return
            new = [s for s in new if not s.cancelled]
            if new:
                batch = self._admit(new, batch)
            if batch is not None:
                running = batch.rows
                try:
                    batch = self._decode(batch)
                except Exception as err:  # a failed decode step fails its batch, not the engine
                    for seq in running:
                        self.fail(seq, err)
                    batch = None

    # ------------------------------------------------------------------ static decode

    def _serve_static(self) -> None:
        assert self._slots is not None
        slots = self._slots
        while True:
            self.flush()
            idle = not slots.holders
            new = self.gather(slots.free, block=idle, wait=self._batch_wait if idle else 0.0)
            if self.stopping:
                for seq in [*new, *slots.holders]:
                    self.refuse(seq)
                return
            new = [s for s in new if not s.cancelled]
            try:
                if new:
                    self._admit_static(new)  # a failed prefill fails only its own rows
                gone = [s for s in slots.holders if s.cancelled or self.drop_if_expired(s)]
                for seq in gone:
                    slots.release(seq, _length)
                if slots.holders:
                    self._decode_static(list(slots.holders))
            except Exception as err:  # a failed decode step fails its batch, not the engine
                for seq in [*new, *slots.holders]:
                    self.fail(seq, err)
                while slots.holders:
                    slots.release(slots.holders[-1], _length)

    def _admit_static(self, new: list[_Seq]) -> None:
        """Prefill ``new`` into free slots. Nothing is sent or written to a slot until the forward pass
        has succeeded, so a failure is the new rows' alone: the group is then prefilled one row at a
        time, and only a row that fails by itself is answered with its error (as in ``_admit``)."""
        try:
            width, out, cache = self._prefill_static(new)
        except Exception as err:
            if len(new) == 1:
                self.fail(new[0], err)
                return
            for seq in new:
                self._admit_static([seq])
            return
        self._seat_static(new, width, out.logits[:, -1, :], cache)

    def _prefill_static(self, new: list[_Seq]) -> tuple[int, Any, DynamicCache]:
        """The new prompts' forward pass together (left-padded); sends nothing."""
        width = max(len(s.prompt_ids) for s in new)
        ids = torch.full((len(new), width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(new), width), dtype=torch.long)
        for i, seq in enumerate(new):
            n = len(seq.prompt_ids)
            ids[i, width - n :] = torch.tensor(seq.prompt_ids, dtype=torch.long)
            mask[i, width - n :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        out = self._model(
            input_ids=ids.to(self._device),
            attention_mask=mask.to(self._device) if len(new) > 1 else None,
            position_ids=positions.to(self._device),
            **cache_kwargs(self._model, cache),
            use_cache=True,
            logits_to_keep=1,
        )
        self.context.metrics.observe_batch(len(new))
        return width, out, cache

    def _seat_static(self, new: list[_Seq], width: int, logits: torch.Tensor, cache: DynamicCache) -> None:
        """Each new row's first token out, and its cache (padding stripped) into its slot."""
        assert self._slots is not None
        tokens = self._sample(logits, new)
        finished = set(self._advance(new, tokens))
        layers = _layers(cache)
        for i, seq in enumerate(new):
            if i in finished:
                continue
            n = len(seq.prompt_ids)
            slot = self._slots.take(seq)
            decoder = self._slots.decoder
            for li, (k, v) in enumerate(layers):
                decoder.keys[li][slot, :, :n].copy_(k[i, :, width - n :])
                decoder.values[li][slot, :, :n].copy_(v[i, :, width - n :])
            seq.length = n

    def _decode_static(self, rows: list[_Seq]) -> None:
        assert self._slots is not None
        ids = torch.tensor([s.last_token for s in rows], dtype=torch.long, device=self._device)
        embeds = self._model.get_input_embeddings()(ids)
        _, logits = self._slots.decoder.step(embeds, [s.length for s in rows])
        self.context.metrics.observe_batch(len(rows))
        for seq in rows:
            seq.length += 1
        tokens = self._sample(logits, rows)
        for i in self._advance(rows, tokens):
            self._slots.release(rows[i], _length)

    # ------------------------------------------------------------------ dynamic decode

    def _admit(self, new: list[_Seq], batch: _Batch | None) -> _Batch | None:
        """Prefill ``new`` into the running batch. The running rows are untouched until a prefill has
        succeeded (it builds a cache of its own), so a failure is the new rows' alone: the group is then
        prefilled one row at a time, and only a row that fails by itself is answered with its error.
        One bad request never fails the requests it happened to arrive with, nor those already running."""
        try:
            merged, tokens = self._prefill(new, batch)
        except Exception as err:
            if len(new) == 1:
                self.fail(new[0], err)
                return batch
            for seq in new:
                batch = self._admit([seq], batch)
            return batch
        # From here on frames go out: nothing below is retried.
        offset = len(merged.rows) - len(new)
        finished = self._advance(new, tokens)
        return self._retire(merged, {offset + i for i in finished})

    def _prefill(self, new: list[_Seq], batch: _Batch | None) -> tuple[_Batch, list[int]]:
        """The running batch with ``new`` prefilled into it, and each new row's first token; sends nothing
        and leaves ``batch`` as it was (the merged batch has a cache of its own)."""
        width = max(len(s.prompt_ids) for s in new)
        ids = torch.full((len(new), width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(new), width), dtype=torch.long)
        for i, seq in enumerate(new):
            n = len(seq.prompt_ids)
            ids[i, width - n :] = torch.tensor(seq.prompt_ids, dtype=torch.long)
            mask[i, width - n :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        out = self._model(
            input_ids=ids.to(self._device),
            attention_mask=mask.to(self._device),
            position_ids=positions.to(self._device),
            **cache_kwargs(self._model, cache),
            use_cache=True,
            logits_to_keep=1,
        )
        self.context.metrics.observe_batch(len(new))
        fresh = _Batch(rows=new, cache=cache, mask=mask.to(self._device), next_pos=mask.sum(-1).to(self._device))
        merged = fresh if batch is None else _merge(batch, fresh)
        return merged, self._sample(out.logits[:, -1, :], new)

    def _decode(self, batch: _Batch) -> _Batch | None:
        gone = {i for i, s in enumerate(batch.rows) if s.cancelled or self.drop_if_expired(s)}
        if gone:
            retired = self._retire(batch, gone)
            if retired is None:
                return None
            batch = retired
        ids = torch.tensor([[s.last_token] for s in batch.rows], dtype=torch.long, device=self._device)
        ones = torch.ones((len(batch.rows), 1), dtype=batch.mask.dtype, device=self._device)
        batch.mask = torch.cat([batch.mask, ones], dim=1)
        out = self._model(
            input_ids=ids,
            attention_mask=batch.mask,
            position_ids=batch.next_pos.unsqueeze(1),
            **cache_kwargs(self._model, batch.cache),
            use_cache=True,
        )
        batch.next_pos = batch.next_pos + 1
        self.context.metrics.observe_batch(len(batch.rows))
        tokens = self._sample(out.logits[:, -1, :], batch.rows)
        return self._retire(batch, set(self._advance(batch.rows, tokens)))

    def _sample(self, logits: torch.Tensor, rows: Sequence[_Seq]) -> list[int]:
        greedy = logits.argmax(dim=-1).tolist()
        tokens: list[int] = []
        for i, seq in enumerate(rows):
            s = seq.sampling
            if s.greedy:
                tokens.append(int(greedy[i]))
                continue
            # In float64 and shifted so the best token scores 0 before the division: the smallest
            # temperature the API accepts (any float > 0, down to 5e-324, which float32 rounds to 0) then
            # gives the others -inf instead of 0/0 = nan.
            row = logits[i].double()
            scores = (row - row.max()) / s.temperature
            if s.top_p < 1.0:
                sorted_scores, order = torch.sort(scores, descending=True)
                probs = torch.softmax(sorted_scores, dim=-1)
                # Drop a token when the tokens ranked above it already cover top_p (keeps at least one).
                drop = (torch.cumsum(probs, dim=-1) - probs) > s.top_p
                sorted_scores[drop] = float("-inf")
                scores = torch.full_like(scores, float("-inf")).scatter(0, order, sorted_scores)
            # The request's generator lives on the CPU: the same seed draws the same tokens on any device.
            probs = torch.softmax(scores, dim=-1).to("cpu")
            tokens.append(int(torch.multinomial(probs, 1, generator=seq.generator).item()))
        return tokens

    def _advance(self, rows: Sequence[_Seq], tokens: Sequence[int]) -> list[int]:
        """Append each row's token, stream its delta, and return the indices of rows that finished."""
        finished: list[int] = []
        produced = 0
        for i, (seq, token) in enumerate(zip(rows, tokens, strict=True)):
            if seq.cancelled:
                finished.append(i)
                continue
            seq.generated += 1
            seq.last_token = token
            seq.tokens.append(token)
            produced += 1
            reason: str | None = None
            if not seq.sampling.ignore_eos and token in self._defaults.eos_token_ids:
                reason, text = "stop", seq.detok.flush()
            else:
                text = seq.detok.add(token)
                if seq.detok.stopped:
                    reason = "stop"
                elif (
                    seq.generated >= seq.sampling.max_tokens
                    or len(seq.prompt_ids) + seq.generated >= self._max_model_len
                ):
                    reason = "length"
                    text += seq.detok.flush()
            if seq.request.stream:
                self.emit(seq, TextFrame(text=text, token_ids=(token,)))
            elif reason is not None:
                # Not streamed: the whole answer in one frame.
                self.emit(seq, TextFrame(text=seq.detok.text, token_ids=tuple(seq.tokens)))
            if reason is not None:
                self.emit(seq, FinalFrame(reason, Usage(len(seq.prompt_ids), seq.generated)))
                finished.append(i)
        self.context.metrics.add_generated_tokens(produced)
        return finished

    def _retire(self, batch: _Batch, gone: set[int]) -> _Batch | None:
        """Remove rows ``gone`` and the cache columns no remaining row attends to."""
        if not gone:
            return batch
        keep = [i for i in range(len(batch.rows)) if i not in gone]
        if not keep:
            return None
        index = torch.tensor(keep, dtype=torch.long, device=self._device)
        batch.cache.batch_select_indices(index)
        batch.rows = [batch.rows[i] for i in keep]
        batch.mask = batch.mask[index]
        batch.next_pos = batch.next_pos[index]
        used = batch.mask.any(dim=0).nonzero()
        first = int(used[0]) if len(used) else 0
        if first > 0:
            batch.mask = batch.mask[:, first:]
            batch.cache = _rebuild(batch.cache, lambda t: t[:, :, first:, :])
        return batch


def _length(seq: _Seq) -> int:
    return seq.length


def _merge(running: _Batch, fresh: _Batch) -> _Batch:
    """One batch from two, left-padding the shorter cache (and its mask) to the longer one's width."""
    width = max(running.mask.shape[1], fresh.mask.shape[1])
    a_pad, b_pad = width - running.mask.shape[1], width - fresh.mask.shape[1]
    a_layers, b_layers = _layers(running.cache), _layers(fresh.cache)
    data = []
    for (ak, av), (bk, bv) in zip(a_layers, b_layers, strict=True):
        data.append(
            (
                torch.cat([_left_pad(ak, a_pad), _left_pad(bk, b_pad)], dim=0),
                torch.cat([_left_pad(av, a_pad), _left_pad(bv, b_pad)], dim=0),
            )
        )
    mask = torch.cat(
        [
            torch.nn.functional.pad(running.mask, (a_pad, 0)),
            torch.nn.functional.pad(fresh.mask, (b_pad, 0)),
        ],
        dim=0,
    )
    return _Batch(
        rows=[*running.rows, *fresh.rows],
        cache=DynamicCache(ddp_cache_data=data),
        mask=mask,
        next_pos=torch.cat([running.next_pos, fresh.next_pos]),
    )


def _layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # DynamicCache keeps (batch, heads, seq, head_dim) tensors per layer; there is no public accessor
    # for them in transformers 5, so this (and _rebuild) is the one place that reads its layers.
    return [(layer.keys, layer.values) for layer in cache.layers]


def _rebuild(cache: DynamicCache, fn: Callable[[torch.Tensor], torch.Tensor]) -> DynamicCache:
    return DynamicCache(ddp_cache_data=[(fn(k), fn(v)) for k, v in _layers(cache)])


def _left_pad(t: torch.Tensor, n: int) -> torch.Tensor:
    if n == 0:
        return t
    return torch.nn.functional.pad(t, (0, 0, n, 0))
