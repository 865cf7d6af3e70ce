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
"""

from __future__ import annotations

import secrets
from typing import Any

import torch
from transformers import (
    AutoTokenizer,
    Qwen2_5OmniThinkerForConditionalGeneration,
    StoppingCriteria,
    StoppingCriteriaList,
)

from omnimodel_runtime.engines.base import StageInput
from omnimodel_runtime.engines.omni_common import (
    PROMPT_KIND,
    REPLY_KIND,
    Job,
    OmniEngine,
    RngTurn,
    Speakers,
    load_config,
    load_part,
    quiet_transformers,
    request_voice,
    rows_to_wire,
    tensor_frame,
)
from omnimodel_runtime.engines.text import (
    GenerationDefaults,
    IncrementalDetokenizer,
    ResolvedSampling,
    render_prompt,
    resolve_sampling,
)
from omnimodel_runtime.errors import StageError
from omnimodel_runtime.protocol.stage import FinalFrame, SamplingParams, StageRequest, TextFrame, Usage


def wants_audio(request: StageRequest) -> bool:
    """Whether this request continues into the talker (the gateway says so in ``params``)."""
    return "audio" in (request.params.get("modalities") or ())


def _only_text(request: StageRequest) -> None:
    for i, message in enumerate(request.messages or ()):
        content = message.get("content")
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise StageError(
                        f"content part of type {kind!r} is not supported: this thinker takes text input only",
                        status=400,
                        param=f"messages.{i}.content",
                    )


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

    @property
    def max_model_len(self) -> int | None:
        return self._max_model_len or None

    def load(self) -> None:
        model_dir = self.context.model_dir
        config = load_config(model_dir)
        self.model = load_part(
            Qwen2_5OmniThinkerForConditionalGeneration,
            model_dir,
            config.thinker_config,
            dtype=self.dtype,
            device=self.device,
        )
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
        text_config = config.thinker_config.get_text_config()
        self._max_model_len = int(self.args.get("max_model_len") or text_config.max_position_embeddings)
        tc = config.thinker_config
        self._placeholders = [tc.audio_token_index, tc.image_token_index, tc.video_token_index]
        self._tts_ids = (config.talker_config.tts_text_end_token_id, config.talker_config.tts_text_pad_token_id)
        if config.enable_audio_output:
            self._speakers = Speakers.load(model_dir)

    async def warmup(self) -> None:
        request = StageRequest(
            request_id=f"warmup-{secrets.token_hex(4)}",
            prompt="Warm up.",
            sampling=SamplingParams(max_tokens=2, temperature=0.0),
            params={"modalities": ["text", "audio"]} if self._speakers is not None else {},
        )
        async for _ in self.generate(StageInput(request=request)):
            pass

    def prepare(self, inp: StageInput, job: Job) -> None:
        request = inp.request
        _only_text(request)
        prompt_ids = render_prompt(self._tokenizer, request)
        sampling = resolve_sampling(
            request, self._defaults, prompt_len=len(prompt_ids), max_model_len=self._max_model_len
        )
        job.data.update(prompt_ids=prompt_ids, sampling=sampling, audio=wants_audio(request))
        if job.data["audio"]:
            if self._speakers is None:
                raise StageError("this checkpoint has no audio output (no talker)", status=400, param="modalities")
            voice = self._speakers.resolve(request_voice(request))
            job.data["speaker_bos"] = int(self._speakers[voice]["bos_token"])

    def run(self, job: Job) -> None:
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
            hooks.append(self.model.model.register_forward_hook(_RowHook(self, job, criterion), with_kwargs=True))
        if turn is not None:
            hooks.append(self.model.register_forward_hook(lambda *_: turn.begin()))
        kwargs: dict[str, Any] = {"max_new_tokens": sampling.max_tokens, "do_sample": not sampling.greedy}
        if not sampling.greedy:
            kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p)
        if sampling.ignore_eos:
            kwargs["min_new_tokens"] = sampling.max_tokens
        try:
            self.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                # The whole model passes this to every part; it only matters for video input.
                use_audio_in_video=False,
                stopping_criteria=StoppingCriteriaList([criterion]),
                **kwargs,
            )
        finally:
            for hook in hooks:
                hook.remove()
            if turn is not None:
                turn.end()
        if not job.request.stream:
            job.emit(TextFrame(text=criterion.detok.text, token_ids=tuple(criterion.tokens)))
        reason = criterion.reason or "length"
        job.emit(FinalFrame(reason, Usage(prompt_tokens=len(prompt_ids), completion_tokens=len(criterion.tokens))))

    # ------------------------------------------------------------ rows for the talker

    def special_rows(self, speaker_bos: int) -> torch.Tensor:
        """The talker's speaker-bos, text-end and text-pad embeddings (thinker ``embed_tokens`` rows)."""
        ids = torch.tensor([speaker_bos, *self._tts_ids], dtype=torch.long, device=self.device)
        rows: torch.Tensor = self.model.get_input_embeddings()(ids)
        return rows

    def placeholder_mask(self, ids: list[int]) -> torch.Tensor:
        tensor = torch.tensor(ids, dtype=torch.long, device=self.device)
        return torch.isin(tensor, torch.tensor(self._placeholders, dtype=torch.long, device=self.device))


class _Stream(StoppingCriteria):  # type: ignore[misc]  # transformers is untyped here
    """Called by ``generate()`` right after each token is drawn: streams it and decides whether to stop."""

    def __init__(self, engine: OmniThinkerEngine, job: Job, sampling: ResolvedSampling, turn: RngTurn | None) -> None:
        self.engine = engine
        self.job = job
        self.sampling = sampling
        self.turn = turn
        self.detok = IncrementalDetokenizer(engine._detok_tokenizer, sampling.stop)
        self.tokens: list[int] = []
        self.reason: str | None = None
        self.limit = min(sampling.max_tokens, engine._max_model_len - len(job.data["prompt_ids"]))

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **_: Any) -> torch.Tensor:
        if self.turn is not None:
            self.turn.end()
        token = int(input_ids[0, -1])
        self.tokens.append(token)
        metrics = self.engine.context.metrics
        metrics.observe_batch(1)
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
        return torch.full((input_ids.shape[0],), self.reason is not None, dtype=torch.bool, device=input_ids.device)


class _RowHook:
    """Forward hook on the thinker's text model: turns each step into talker rows."""

    def __init__(self, engine: OmniThinkerEngine, job: Job, stream: _Stream) -> None:
        self.engine = engine
        self.job = job
        self.stream = stream
        self.prefilled = False

    def __call__(self, module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        embeds: torch.Tensor = kwargs["inputs_embeds"][0]
        hidden: torch.Tensor = output.last_hidden_state[0]
        if not self.prefilled:
            self.prefilled = True
            prompt_ids: list[int] = self.job.data["prompt_ids"]
            # The talker must not see the audio/image features, only their positions.
            embeds = embeds.masked_fill(self.engine.placeholder_mask(prompt_ids).unsqueeze(-1), 0.0)
            rows, dtype = rows_to_wire(hidden + embeds)
            special, _ = rows_to_wire(self.engine.special_rows(self.job.data["speaker_bos"]))
            self.job.emit(
                tensor_frame(
                    PROMPT_KIND,
                    {"prompt_rows": rows, "prompt_ids": torch.tensor(prompt_ids).numpy(), "special_rows": special},
                    dtype=dtype,
                    speaker_bos_token=self.job.data["speaker_bos"],
                )
            )
            return
        # A decode step's input is the token sampled last; its row is what talker step t needs.
        rows, dtype = rows_to_wire(hidden + embeds)
        token = self.stream.tokens[-1]
        self.job.emit(tensor_frame(REPLY_KIND, {"rows": rows, "token_ids": torch.tensor([token]).numpy()}, dtype=dtype))
