"""The Qwen2.5-Omni thinker stage: chat text out, plus (for audio requests) the rows the talker needs.

Runs ``Qwen2_5OmniThinkerForConditionalGeneration.generate()`` itself, exactly as the whole model's
``generate()`` does, and watches it through two hooks instead of asking for ``output_hidden_states``
(which keeps every layer of every step — at real size ~15x the memory of what the talker uses):

- a forward hook on the text model reads the step's input embeddings and final-normed hidden state, and
  streams ``embedding + hidden`` rows: all prompt rows after the prefill (embeddings zeroed at multimodal
  placeholders, as the whole model does), then one row per generated token as soon as the step that
  consumes that token has run — talker step t needs row t only, so the talker starts right away;
- a stopping criterion sees each sampled token first: it streams the text delta, applies stop strings,
  the deadline and cancellation, and ends the request's turn on the global generator (:class:`RngTurn`).

Text-only requests skip the row hook entirely. Frame layouts: docs/pipelines/qwen2.5-omni.md.

**Forced replies** (``/v1/audio/speech``: say exactly this text). Instead of sampling, a logits processor
teacher-forces the given reply tokens one decode step at a time, and the same hooks stream the same rows
— bit for bit the rows of a generation that happened to produce those tokens, since every forward pass
is the same call on the same inputs (one decode step per token rather than one batched pass, which would
round differently). The talker and code2wav cannot tell the difference. A speech request's prompt frames
the reply as the answer to "repeat this text" under the released model's default system prompt (see
:meth:`OmniThinkerEngine.speech_prompt`); a forced reply sends no text to anyone.

This module is the engine: loading, requests one at a time through ``generate()``, and batched serving over
decode slots. The speech and media prompts are :mod:`~omnimodel_runtime.engines.omni.thinker_prompts`; the
criterion, logits processor and hook that watch ``generate()`` are
:mod:`~omnimodel_runtime.engines.omni.thinker_stream`.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.hooks import RemovableHandle
from transformers import (
    AutoTokenizer,
    LogitsProcessorList,
    Qwen2_5OmniThinkerForConditionalGeneration,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopPLogitsWarper,
)

from omnimodel_runtime.engines.devices import sdpa_scope
from omnimodel_runtime.engines.omni.common import (
    REPLY_KIND,
    USE_AUDIO_IN_VIDEO,
    VIDEO_SECONDS,
    RngTurn,
    Speakers,
    generate,
    load_config,
    load_part,
    quiet_transformers,
    rows_to_wire,
    tensor_frame,
    voice_param,
)
from omnimodel_runtime.engines.omni.engine import OmniEngine, OmniJob
from omnimodel_runtime.engines.omni.inputs import load_processor
from omnimodel_runtime.engines.omni.thinker_prompts import (
    _TEXT_MARK,
    SPEECH_INSTRUCTION,
    SPEECH_SYSTEM_PROMPT,
    _reply_ids,
    media_prompt,
    speech_frame,
    wants_audio,
)
from omnimodel_runtime.engines.omni.thinker_stream import _Force, _RowHook, _Stream, talker_media
from omnimodel_runtime.engines.slots import SlotDecoder, SlotTable, supported
from omnimodel_runtime.engines.text.common import (
    GenerationDefaults,
    ResolvedSampling,
    render_prompt,
    resolve_sampling,
)
from omnimodel_runtime.engines.worker import CancelledRequestError
from omnimodel_runtime.errors import StageError
from omnimodel_runtime.pipeline import Modality
from omnimodel_runtime.protocol.stage import (
    QUERY_VOICES,
    FinalFrame,
    ResponseFrame,
    SamplingParams,
    StageInput,
    StageParams,
    StageRequest,
    TensorFrame,
    TextFrame,
    Usage,
)

# The prompts and generate()'s watchers have modules of their own; every name that lived here stays
# importable from here (other engine families build on them).
__all__ = [
    "SPEECH_INSTRUCTION",
    "SPEECH_SYSTEM_PROMPT",
    "_TEXT_MARK",
    "OmniThinkerEngine",
    "_Force",
    "_RowHook",
    "_Stream",
    "_ThinkerRow",
    "_reply_ids",
    "talker_media",
    "wants_audio",
]

log = logging.getLogger(__name__)


class OmniThinkerEngine(OmniEngine):
    """``transformers`` adapter for the ``omni-thinker`` task."""

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        self.model: Any = None
        self._tokenizer: Any = None
        # The event loop renders prompts while the worker detokenizes: two tokenizer instances.
        self._detok_tokenizer: Any = None
        self._speakers: Speakers | None = None
        self._defaults = GenerationDefaults()
        self._max_model_len = 0
        self._placeholders: list[int] = []
        self._tts_ids: tuple[int, int] = (0, 0)
        self._vocab = 0
        # Token ids of the speech prompt before and after the input text (None: the template cannot).
        self._speech_frame: tuple[list[int], list[int]] | None = None
        self._slots: SlotTable | None = None  # batched serving: the decode slots
        # Audio and image input: the checkpoint's processor (None: it ships none), used on threads of the
        # event loop's executor one request at a time (its tokenizer is not safe to share).
        self._processor: Any = None
        self._processor_lock = threading.Lock()
        self._stream_priority = -1  # ahead of code2wav's DiT passes on a shared GPU

    @property
    def max_model_len(self) -> int | None:
        return self._max_model_len or None

    def load_part(self) -> None:
        model_dir = self.context.model_dir
        config = load_config(model_dir)
        self.model = load_part(
            Qwen2_5OmniThinkerForConditionalGeneration,
            model_dir,
            config.thinker_config,
            dtype=self.dtype,
            device=self.device,
        )
        tc = config.thinker_config
        self._placeholders = [tc.audio_token_index, tc.image_token_index, tc.video_token_index]
        self._tts_ids = (config.talker_config.tts_text_end_token_id, config.talker_config.tts_text_pad_token_id)
        if config.enable_audio_output:
            self._speakers = Speakers.load(model_dir)
        self._processor = load_processor(model_dir)
        self.loaded(tc.get_text_config())

    def loaded(self, text_config: Any) -> None:
        """What every thinker family does once its model is loaded: tokenizers, generation defaults, the
        context limit, the speech prompt frame, batched serving's slots."""
        model_dir = self.context.model_dir
        with quiet_transformers():
            self._tokenizer = AutoTokenizer.from_pretrained(model_dir)
            self._detok_tokenizer = AutoTokenizer.from_pretrained(model_dir)
        gen = self.model.generation_config
        eos = gen.eos_token_id
        eos_ids = frozenset(eos if isinstance(eos, list) else [] if eos is None else [eos])
        temperature = float(gen.temperature or 1.0) if gen.do_sample else 0.0
        self._defaults = GenerationDefaults(
            temperature=temperature, top_p=float(gen.top_p or 1.0), eos_token_ids=eos_ids
        )
        self._max_model_len = int(self.args.get("max_model_len") or text_config.max_position_embeddings)
        self._vocab = int(text_config.vocab_size)
        self._speech_frame = speech_frame(
            self._tokenizer,
            str(self.args.get("speech_system_prompt", SPEECH_SYSTEM_PROMPT)),
            str(self.args.get("speech_instruction", SPEECH_INSTRUCTION)),
        )
        if self._speech_frame is None:
            # Chat still works; only speech, which needs the text at a known place, does not.
            log.warning("The chat template does not render a user message verbatim: speech requests are refused")
        if self.batched:
            self._load_slots()

    def _load_slots(self) -> None:
        problem = supported(self.model.model)
        if problem is not None:
            log.warning("The thinker serves one request at a time: %s", problem)
            self.batched = False
            return
        # Every request must fit a slot: the context limit becomes the slot capacity.
        self._max_model_len = min(self._max_model_len, int(self.args.get("slot_capacity", 4096)))
        decoder = self._slot_decoder(
            self.model.model,
            self.model.lm_head,
            slots=self.max_batch,
            capacity=self._max_model_len,
            graphs=self.graphs,
            compiled=self.compiled,
        )
        decoder.capture_all()
        self._slots = SlotTable(decoder)

    def _slot_decoder(self, model: Any, lm_head: Any, **options: Any) -> SlotDecoder:
        """The decoder of batched serving's slots; a model family whose decode step differs (Qwen3's
        query/key norms) returns its own."""
        return SlotDecoder(model, lm_head, **options)

    def speech_prompt(self, text: str) -> tuple[list[int], list[int]]:
        """The prompt and the forced reply of a speech request, as token ids.

        The prompt is the chat: system = :data:`SPEECH_SYSTEM_PROMPT`, user = :data:`SPEECH_INSTRUCTION`
        followed by the text, then the assistant's turn; the reply is the text. Control-token strings in
        the text (``<|im_end|>``) stay plain text: the input cannot end the reply or the user turn.
        """
        if self._speech_frame is None:
            raise StageError(
                "this model's chat template cannot frame a speech request", status=501, type="not_implemented"
            )
        reply: list[int] = self._tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
        head, tail = self._speech_frame
        return [*head, *reply, *tail], reply

    def query(self, request: StageRequest) -> list[ResponseFrame] | None:
        if request.params.query != QUERY_VOICES:
            return None
        if self._speakers is None:
            return [FinalFrame("stop")]  # no voices: the speech route says so
        meta = {"voices": self._speakers.names, "default": self._speakers.default}
        return [TensorFrame({}, meta=meta), FinalFrame("stop")]

    async def warmup(self) -> None:
        request = StageRequest(
            request_id=f"warmup-{secrets.token_hex(4)}",
            prompt="Warm up.",
            sampling=SamplingParams(max_tokens=2, temperature=0.0),
            params=StageParams(modalities=(Modality.TEXT, Modality.AUDIO) if self._speakers is not None else ()),
        )
        async for _ in self.generate(StageInput(request=request)):
            pass

    async def admit(self, inp: StageInput, job: OmniJob) -> None:
        if inp.request.media:
            # Decoding, resampling, feature extraction and frame resizing take a while (the released
            # feature extractor pads every clip to 300 s): on a thread, not on the event loop.
            job.data["media"] = await asyncio.to_thread(
                media_prompt, self._processor, self._processor_lock, inp, self._vocab
            )
        self.prepare(inp, job)

    def prepare(self, inp: StageInput, job: OmniJob) -> None:
        request = inp.request
        reply: list[int] | None
        if request.params.speak:
            text = request.prompt or ""
            if not text.strip():
                raise StageError("input must contain text to speak", status=400, param="input")
            prompt_ids, reply = self.speech_prompt(text)
        else:
            media = job.data.get("media")
            if request.media and media is None:
                raise StageError("media input needs the engine's admit() (not prepare() alone)", status=500)
            if media is not None:
                prompt_ids = media["prompt_ids"]
            else:
                prompt_ids = render_prompt(self._tokenizer, request, vocab_size=self._vocab)
            reply = _reply_ids(request, self._vocab, self._defaults.eos_token_ids)
        if reply is not None:
            if not reply:
                raise StageError("the reply to force is empty", status=400, param="input")
            # Every reply token is consumed by a decode step, and one more step ends the reply.
            needed = len(prompt_ids) + len(reply) + 1
            if needed > self._max_model_len:
                raise StageError(
                    f"the input is too long: speaking it takes {needed} tokens of context (with the prompt that "
                    f"frames it), this model has {self._max_model_len}",
                    status=400,
                    param="input",
                )
            sampling = ResolvedSampling(
                max_tokens=len(reply) + 1, temperature=0.0, top_p=1.0, seed=None, stop=(), ignore_eos=False
            )
        else:
            sampling = resolve_sampling(
                request, self._defaults, prompt_len=len(prompt_ids), max_model_len=self._max_model_len
            )
        job.data.update(prompt_ids=prompt_ids, sampling=sampling, audio=wants_audio(request), reply=reply)
        if job.data["audio"]:
            if self._speakers is None:
                raise StageError("this checkpoint has no audio output (no talker)", status=400, param="modalities")
            voice = self._speakers.resolve(request.params.voice, param=voice_param(request))
            job.data["speaker_bos"] = self.speaker_token(voice)

    def speaker_token(self, voice: str) -> int:
        """The id the talker starts ``voice``'s speech with (Qwen2.5-Omni: a thinker-vocabulary token)."""
        assert self._speakers is not None
        return int(self._speakers[voice]["bos_token"])

    def _generate(self, job: OmniJob, *, max_new_tokens: int | None = None) -> tuple[Any, _Stream, RngTurn | None]:
        """``generate()`` for ``job`` with its hooks (``max_new_tokens``: stop after that many tokens, for
        the batched path's prefill); returns its output, the stream criterion and the request's turn."""
        prompt_ids: list[int] = job.data["prompt_ids"]
        sampling: ResolvedSampling = job.data["sampling"]
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        turn = None
        if not sampling.greedy:
            seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
            turn = RngTurn(self.device, seed)
        criterion = _Stream(self, job, sampling, turn)
        hooks = []
        if job.data["audio"]:
            hooks.extend(self.row_hooks(job, criterion))
        if turn is not None:
            hooks.append(self.model.register_forward_hook(lambda *_: turn.begin()))
        limit = sampling.max_tokens if max_new_tokens is None else min(max_new_tokens, sampling.max_tokens)
        kwargs: dict[str, Any] = {"max_new_tokens": limit, "do_sample": not sampling.greedy}
        if max_new_tokens is not None:
            kwargs["return_dict_in_generate"] = True
        if not sampling.greedy:
            kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p)
        if sampling.ignore_eos:
            kwargs["min_new_tokens"] = limit
        reply: list[int] | None = job.data["reply"]
        if reply is not None:
            kwargs["logits_processor"] = LogitsProcessorList([_Force(reply, len(prompt_ids))])
        kwargs.update(self._media_kwargs(job))
        media = job.data.get("media")
        try:
            with sdpa_scope(self.prefill_attention):
                out = generate(
                    self.model,
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    # The whole model passes this to every part: a video's audio interleaved with its frames
                    # shifts the M-RoPE positions of both.
                    use_audio_in_video=bool(media and media[USE_AUDIO_IN_VIDEO]),
                    stopping_criteria=StoppingCriteriaList([criterion]),
                    **kwargs,
                )
        finally:
            for hook in hooks:
                hook.remove()
            if turn is not None:
                turn.end()
        return out, criterion, turn

    def _media_kwargs(self, job: OmniJob) -> dict[str, torch.Tensor]:
        """The encoders' inputs of a request with media (features and pixels in the model's dtype; a
        video's seconds per temporal patch as the processor gave them, as the whole model takes them: they
        scale M-RoPE time positions, which bfloat16 would round)."""
        media = job.data.get("media")
        if media is None:
            return {}
        out: dict[str, torch.Tensor] = {}
        for name, tensor in media["inputs"].items():
            moved = tensor.to(self.device)
            cast = moved.is_floating_point() and name != VIDEO_SECONDS
            out[name] = moved.to(self.dtype) if cast else moved
        return out

    def run(self, job: OmniJob) -> None:
        _, criterion, _ = self._generate(job)
        self._finish(job, criterion)

    def _finish(self, job: OmniJob, criterion: _Stream) -> None:
        prompt_ids: list[int] = job.data["prompt_ids"]
        reply: list[int] | None = job.data["reply"]
        if reply is not None:
            usage = Usage(prompt_tokens=len(prompt_ids), completion_tokens=len(reply))
            job.emit(FinalFrame("stop", usage))
            return
        if not job.request.stream:
            job.emit(TextFrame(text=criterion.detok.text, token_ids=tuple(criterion.tokens)))
        reason = criterion.reason or "length"
        job.emit(FinalFrame(reason, Usage(prompt_tokens=len(prompt_ids), completion_tokens=len(criterion.tokens))))

    # ------------------------------------------------------------ batched serving

    def _prefill(self, job: OmniJob) -> bool:
        """Batched path: the prompt through ``generate()`` (one token; the prompt rows and the first text
        delta go out as in the one-at-a-time path), then its cache into a slot. True when it finished."""
        assert self._slots is not None
        out, criterion, turn = self._generate(job, max_new_tokens=1)
        if criterion.reason is not None:
            self._finish(job, criterion)
            return True
        length = len(job.data["prompt_ids"])
        row = _ThinkerRow(
            job=job,
            stream=criterion,
            length=length,
            last=criterion.tokens[-1],
            generator=turn.generator() if turn is not None else None,
        )
        slot = self._slots.take(row)
        self._slots.decoder.load(slot, out.past_key_values, length)
        job.state = row
        return False

    def advance(self, jobs: list[OmniJob]) -> tuple[list[OmniJob], bool]:
        assert self._slots is not None
        finished: list[OmniJob] = []
        moved = False
        for job in jobs:
            if job.state is not None or self._slots.free <= 0:
                continue
            moved = True
            with self.alone(job, finished):
                if "media" in job.data:
                    # Audio and images shift the M-RoPE positions of everything after them (rope_deltas),
                    # which the slot decoder does not carry: such a request runs whole through
                    # generate(), holding up the batch until it is done.
                    self.run(job)
                    finished.append(job)
                elif self._prefill(job):
                    finished.append(job)
        rows: list[_ThinkerRow] = list(self._slots.holders)
        if rows:
            moved = True
            with self.one_wake_up():
                finished.extend(self._decode(rows))
        return finished, moved

    def _decode(self, rows: list[_ThinkerRow]) -> list[OmniJob]:
        """One batched decode step of every row: each consumes its last token (its talker row goes out),
        then picks the next one."""
        assert self._slots is not None
        tokens = torch.tensor([r.last for r in rows], dtype=torch.long, device=self.device)
        embeds = self.model.get_input_embeddings()(tokens)
        hidden, logits = self._slots.decoder.step(embeds, [r.length for r in rows])
        audio = [i for i, r in enumerate(rows) if r.job.data["audio"]]
        wire: dict[int, Any] = {}
        if audio:
            picked = torch.tensor(audio, device=self.device)
            arr, dtype = rows_to_wire(hidden.index_select(0, picked) + embeds.index_select(0, picked))
            wire = {i: (arr[k : k + 1], dtype) for k, i in enumerate(audio)}
        self.context.metrics.observe_batch(len(rows))
        picks = self._pick(rows, logits)
        done: list[_ThinkerRow] = []
        for i, (row, token) in enumerate(zip(rows, picks, strict=True)):
            row.length += 1
            job = row.job
            if i in wire:
                arr, dtype = wire[i]
                job.emit(tensor_frame(REPLY_KIND, {"rows": arr, "token_ids": np.array([row.last])}, dtype=dtype))
            try:
                stop = row.stream.take(token)
            except CancelledRequestError:
                done.append(row)
                continue
            except Exception as err:
                self.fail(job, err)
                done.append(row)
                continue
            row.last = token
            if stop:
                self._finish(job, row.stream)
                done.append(row)
        for row in done:
            self.release(row.job)
        return [row.job for row in done]

    def _pick(self, rows: list[_ThinkerRow], logits: torch.Tensor) -> list[int]:
        """Each row's next token, as ``generate()`` picks it: greedy, forced (speech), or sampled with the
        request's temperature and top-p from its own random stream; ``ignore_eos`` rows never pick an
        end-of-sequence token (``min_new_tokens`` in ``generate()``)."""
        eos = sorted(self._defaults.eos_token_ids)
        for i, row in enumerate(rows):
            if row.stream.sampling.ignore_eos and eos:
                logits[i, eos] = float("-inf")
        greedy: list[int] = logits.argmax(dim=-1).tolist()
        out: list[int] = []
        for i, row in enumerate(rows):
            reply, sampling = row.stream.reply, row.stream.sampling
            if reply is not None:
                step = len(row.stream.tokens)
                out.append(reply[step] if step < len(reply) else greedy[i])
            elif sampling.greedy or row.generator is None:
                out.append(greedy[i])
            else:
                # In float64 and shifted so the best token scores 0: the smallest temperature the API
                # accepts (down to 5e-324, which float32 rounds to 0) then gives the others -inf, not nan.
                scores = logits[i : i + 1].double()
                scores = TemperatureLogitsWarper(sampling.temperature)(None, scores - scores.max())
                if sampling.top_p < 1.0:
                    scores = TopPLogitsWarper(sampling.top_p)(None, scores)
                probs = torch.softmax(scores, dim=-1)
                out.append(int(torch.multinomial(probs, 1, generator=row.generator).item()))
        return out

    def release(self, job: OmniJob) -> None:
        row = job.state
        if self._slots is not None and isinstance(row, _ThinkerRow) and row in self._slots.holders:
            self._slots.release(row, lambda r: int(r.length))

    # ------------------------------------------------------------ rows for the talker

    # The prompt frame's meta key of the voice's id (``job.data["speaker_bos"]``), as the talker reads it.
    speaker_meta: str = "speaker_bos_token"

    def row_hooks(self, job: OmniJob, stream: _Stream) -> list[RemovableHandle]:
        """The forward hooks that stream ``job``'s rows to the talker during its ``generate()`` (which
        removes them): one on :attr:`text_model`."""
        return [self.text_model.register_forward_hook(_RowHook(self, job, stream), with_kwargs=True)]

    @property
    def text_model(self) -> Any:
        """The thinker's text decoder: the module called with the step's ``inputs_embeds`` whose output's
        ``last_hidden_state`` is final-normed. transformers 5.19 keeps it at ``thinker.model``; in 5.24
        ``thinker.model`` is the multimodal model and the decoder is its ``language_model`` (with the old
        attribute, the hook saw ``inputs_embeds=None``: "'NoneType' object is not subscriptable")."""
        inner = self.model.model
        return getattr(inner, "language_model", inner)

    def prompt_rows(self, embeds: torch.Tensor, output: Any, job: OmniJob) -> torch.Tensor:
        """The talker's rows of the prompt from the prefill's input embeddings and the text model's output:
        embedding + final-normed hidden state (embeddings zeroed at the placeholders: the talker must not
        see the audio/image features, only their positions)."""
        embeds = embeds.masked_fill(self.placeholder_mask(job.data["prompt_ids"]).unsqueeze(-1), 0.0)
        rows: torch.Tensor = output.last_hidden_state[0] + embeds
        return rows

    def reply_rows(self, embeds: torch.Tensor, output: Any) -> torch.Tensor:
        """The talker's row of one consumed reply token: embedding + final-normed hidden state."""
        rows: torch.Tensor = output.last_hidden_state[0] + embeds
        return rows

    def special_rows(self, speaker_bos: int) -> torch.Tensor:
        """The talker's speaker-bos, text-end and text-pad embeddings (thinker ``embed_tokens`` rows)."""
        ids = torch.tensor([speaker_bos, *self._tts_ids], dtype=torch.long, device=self.device)
        rows: torch.Tensor = self.model.get_input_embeddings()(ids)
        return rows

    def placeholder_mask(self, ids: list[int]) -> torch.Tensor:
        tensor = torch.tensor(ids, dtype=torch.long, device=self.device)
        return torch.isin(tensor, torch.tensor(self._placeholders, dtype=torch.long, device=self.device))


@dataclass(eq=False)
class _ThinkerRow:
    """A request of the batched thinker, holding a cache slot: ``length`` positions cached, ``last`` the
    token its next step consumes."""

    job: OmniJob
    stream: _Stream
    length: int
    last: int
    generator: torch.Generator | None
