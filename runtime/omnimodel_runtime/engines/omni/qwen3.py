"""The Qwen3-Omni stage engines: MoE thinker -> talker (with its code predictor) -> code2wav.

They follow the body of ``Qwen3OmniMoeForConditionalGeneration.generate()`` (transformers), on the Qwen2.5-Omni
engines' mechanism (:class:`~omnimodel_runtime.engines.omni.engine.OmniEngine`: a worker thread fed the
upstream frames, one request at a time, cancellation checked at every step):

- **thinker** (:class:`Qwen3ThinkerEngine`): the Qwen2.5-Omni thinker engine (chat template, sampling, stop
  strings, forced replies, voices, audio, image and video input through ``Qwen3OmniMoeProcessor``) on
  ``Qwen3OmniMoeThinkerForConditionalGeneration``. The talker reads the thinker's *input embeddings* of text
  positions (its ``text_projection`` of them) and, at audio/image/video placeholders of the prompt, the hidden
  states of layer ``accept_hidden_layer`` (its ``hidden_projection``), so the row hook streams those: every
  prompt position after the prefill (a forward hook on that decoder layer keeps the prefill's output), then
  one embedding row per consumed reply token.
- **talker** (:class:`Qwen3TalkerEngine`): builds the whole model's talker inputs (user turns and the
  assistant's first tokens projected, the ``trailing_text_hidden`` of the rest of the reply, ``tts_pad``, the
  media's feature lengths, patch grids and a video's seconds per temporal patch for its M-RoPE) and runs
  ``Qwen3OmniMoeTalkerForConditionalGeneration.generate()``: each step samples a first-group code, and the
  next step's code predictor draws its residual codes; one frame of ``num_code_groups`` codes goes to code2wav
  per step. It starts when the thinker has finished: the whole model projects the assistant's text in one
  batch, and projecting rows as they arrive rounds differently (measured on CPU: rows of fewer than four),
  so waiting is what keeps the split equal to the whole model.
- **code2wav** (:class:`Qwen3Code2WavEngine`): ``Qwen3OmniMoeCode2Wav`` (codes -> 24 kHz waveform, no
  randomness). Whole path (non-streamed requests): ``chunked_decode(codes, 300, 25)`` as the whole model;
  streamed: chunks of ``stream_chunk`` codes as they arrive, each with ``left_context`` codes before it and
  one after, joined without gaps (within 1 LSB of one pass; see :data:`STREAM_CHUNK`).

Video input is Qwen2.5-Omni's (:mod:`.video`, :mod:`.inputs`): the same video processor class, with
Qwen3's sizes and time positions from its processor. Frame layouts: docs/pipelines/qwen3-omni.md.
"""

from __future__ import annotations

import logging
import threading
import warnings
from typing import Any, Final

import numpy as np
import torch
from torch.utils.hooks import RemovableHandle
from transformers import (
    Qwen3OmniMoeConfig,
    Qwen3OmniMoeProcessor,
    Qwen3OmniMoeThinkerForConditionalGeneration,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeCode2Wav,
    Qwen3OmniMoeTalkerForConditionalGeneration,
)

from omnimodel_runtime.engines.devices import sdpa_scope
from omnimodel_runtime.engines.omni.common import (
    AUDIO_LENGTHS,
    AUDIO_META,
    CODES_KIND,
    IMAGE_GRID,
    PROMPT_KIND,
    REPLY_KIND,
    SAMPLE_RATE,
    VIDEO_GRID,
    VIDEO_SECONDS,
    RngTurn,
    Speakers,
    generate,
    generation_overrides,
    load_part,
    load_prefixed,
    quiet_transformers,
    request_seed,
    rows_from_wire,
    rows_to_wire,
    tensor_frame,
)
from omnimodel_runtime.engines.omni.engine import OmniEngine, OmniJob
from omnimodel_runtime.engines.omni.inputs import load_processor
from omnimodel_runtime.engines.omni.talker import warm_up_talker
from omnimodel_runtime.engines.omni.thinker import OmniThinkerEngine
from omnimodel_runtime.errors import StageError
from omnimodel_runtime.protocol.stage import (
    FinalFrame,
    StageInput,
    StageParams,
    TensorFrame,
    Usage,
)

log = logging.getLogger(__name__)

# The whole model's generate() default voice.
DEFAULT_VOICE: Final = "Ethan"
# The whole model's generate() defaults for its talker (eos and the suppressed ids come from the config).
TALKER_DEFAULTS: Final[dict[str, Any]] = {
    "max_new_tokens": 4096,
    "do_sample": True,
    "top_k": 50,
    "top_p": 1.0,
    "temperature": 0.9,
    "repetition_penalty": 1.05,
}
# The whole model suppresses the last 1024 ids of the codec vocabulary (all but end-of-speech).
SUPPRESSED_TAIL: Final = 1024
# The whole model's code2wav chunking (codes): chunks of 300 with 25 codes of left context.
WHOLE_CHUNK: Final = 300
WHOLE_CONTEXT: Final = 25
# The streamed path: chunks of 12 codes (0.96 s) with the vocoder's attention window (72 codes, its
# sliding_window) as left context and one code of look-ahead. Measured on the tiny model, 100 codes: within
# 3e-5 of one pass over all codes (1.2e-7 with 100 codes of context), i.e. at most 1 LSB in 16-bit PCM.
STREAM_CHUNK: Final = 12
STREAM_CONTEXT: Final = 72


def load_config(model_dir: Any) -> Any:
    with quiet_transformers():
        return Qwen3OmniMoeConfig.from_pretrained(model_dir)


def speakers(talker_config: Any) -> Speakers:
    """The voices of the talker config's ``speaker_id`` map (``{name: codec id}``, lower-case names)."""
    ids: dict[str, int] = dict(talker_config.speaker_id or {})
    if not ids:
        raise RuntimeError("the talker config names no speakers (talker_config.speaker_id)")
    return Speakers(
        entries={name.capitalize(): {"codec_id": int(i)} for name, i in ids.items()}, preferred=DEFAULT_VOICE
    )


_conversion_lock = threading.Lock()


def fused_experts_loading(cls: type) -> None:
    """Make ``cls.from_pretrained`` fuse the checkpoint's per-expert MoE weights (``experts.<i>.gate_proj``
    ...) as the whole model's loading does. transformers 5.19 registers that conversion for the whole model
    and the thinker but not for the talker loaded alone, which then reports its experts' weights missing."""
    from transformers.conversion_mapping import (  # noqa: PLC0415  (only this loader needs them)
        get_checkpoint_conversion_mapping,
        register_checkpoint_conversion_mapping,
    )

    with _conversion_lock:
        if get_checkpoint_conversion_mapping(cls.__name__) is None:
            register_checkpoint_conversion_mapping(cls.__name__, get_checkpoint_conversion_mapping("qwen3_omni_moe"))


def lend_audio_config(talker: Any, config: Any) -> None:
    """Give ``talker`` (a ``Qwen3OmniMoeTalkerForConditionalGeneration``) the thinker's audio encoder config.

    transformers 5.19's M-RoPE index, which the talker shares with the thinker, counts each audio's tokens
    with ``self.config.audio_config.n_window``; the talker's config has no ``audio_config``, so a prompt with
    audio and an image or a video (a video's own track included) fails there, in the whole model's
    ``generate()`` as well. The count it needs is the thinker's (its audio encoder made those tokens), so the
    talker reads the thinker's config, as the whole model does once given the same (the tests' reference)."""
    if not hasattr(talker.config, "audio_config"):
        talker.config.audio_config = config.thinker_config.audio_config


def one_at_a_time(engine: OmniEngine) -> None:
    """The Qwen3-Omni engines serve one request at a time (batched decoding is Qwen2.5-Omni's only)."""
    if engine.batched:
        log.warning(
            "Stage %s serves one request at a time: batching is not implemented for Qwen3-Omni", engine.stage.name
        )
        engine.batched = False


# ---------------------------------------------------------------- thinker


class Qwen3ThinkerEngine(OmniThinkerEngine):
    """``transformers`` adapter for the ``qwen3-omni-thinker`` task."""

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        self._special_ids: tuple[int, int, int] = (0, 0, 0)
        # The thinker layer whose hidden states the talker reads at audio/image/video positions (the whole
        # model's hidden_states[accept_hidden_layer]: 0 the input embeddings, N the final-normed output).
        self._accept_layer = 0

    def load_part(self) -> None:
        model_dir = self.context.model_dir
        config = load_config(model_dir)
        self.model = load_part(
            Qwen3OmniMoeThinkerForConditionalGeneration,
            model_dir,
            config.thinker_config,
            dtype=self.dtype,
            device=self.device,
        )
        # The whole model's generate() ends the text at <|im_end|> (its thinker_eos_token_id).
        self.model.generation_config.eos_token_id = int(config.im_end_token_id)
        tc = config.thinker_config
        self._placeholders = [tc.audio_token_id, tc.image_token_id, tc.video_token_id]
        self._special_ids = (config.tts_bos_token_id, config.tts_eos_token_id, config.tts_pad_token_id)
        if config.enable_audio_output:
            self._speakers = speakers(config.talker_config)
        self._accept_layer = int(config.talker_config.accept_hidden_layer)
        layers = int(tc.get_text_config().num_hidden_layers)
        if not 0 <= self._accept_layer <= layers:
            raise RuntimeError(f"talker_config.accept_hidden_layer {self._accept_layer} is not in 0..{layers}")
        self._processor = load_processor(model_dir, Qwen3OmniMoeProcessor)
        one_at_a_time(self)
        self.loaded(tc.get_text_config())

    def speaker_token(self, voice: str) -> int:
        """Qwen3-Omni starts a voice's speech with its codec id (the talker's vocabulary)."""
        assert self._speakers is not None
        return int(self._speakers[voice]["codec_id"])

    # The talker reads the voice as a codec id.
    speaker_meta = "speaker_id"

    def row_hooks(self, job: OmniJob, stream: Any) -> list[RemovableHandle]:
        hooks = super().row_hooks(job, stream)
        if job.data.get("media") is not None and 0 < self._accept_layer < len(self.text_model.layers):
            # The talker reads that decoder layer's output (before any deepstack visual features are added
            # to it, as the whole model records it) at the placeholders of the prompt: kept from the prefill.
            capture = job.data["accepted"] = _Prefill()
            hooks.append(self.text_model.layers[self._accept_layer - 1].register_forward_hook(capture))
        return hooks

    def prompt_rows(self, embeds: torch.Tensor, output: Any, job: OmniJob) -> torch.Tensor:
        """The prompt's input embeddings (the talker projects them itself, ``text_projection``), and at
        audio/image/video placeholders the hidden states of layer ``accept_hidden_layer`` (``hidden_projection``)."""
        if job.data.get("media") is None:
            return embeds
        if self._accept_layer == 0:
            hidden = embeds
        elif self._accept_layer == len(self.text_model.layers):
            hidden = output.last_hidden_state[0]
        else:
            hidden = job.data["accepted"].output[0]
        mask = self.placeholder_mask(job.data["prompt_ids"]).unsqueeze(-1)
        return torch.where(mask, hidden, embeds)

    def reply_rows(self, embeds: torch.Tensor, output: Any) -> torch.Tensor:
        return embeds

    def special_rows(self, speaker_bos: int) -> torch.Tensor:
        """The ``tts_bos``, ``tts_eos`` and ``tts_pad`` embeddings (thinker ``embed_tokens`` rows)."""
        ids = torch.tensor([self._special_ids], dtype=torch.long, device=self.device)
        rows: torch.Tensor = self.model.get_input_embeddings()(ids)[0]
        return rows


class _Prefill:
    """Forward hook keeping a module's output of its first call (the prefill's)."""

    def __init__(self) -> None:
        self.output: torch.Tensor | None = None

    def __call__(self, module: Any, args: Any, output: Any) -> None:
        if self.output is None:
            # A decoder layer returns its hidden states (a tuple led by them in some releases).
            self.output = output[0] if isinstance(output, tuple) else output


# ---------------------------------------------------------------- talker


class Qwen3TalkerEngine(OmniEngine):
    """``transformers`` adapter for the ``qwen3-omni-talker`` task."""

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        self.model: Any = None
        self.config: Any = None
        self._generation: dict[str, Any] = dict(TALKER_DEFAULTS)
        self._stream_priority = -1  # ahead of code2wav on a shared GPU

    def load_part(self) -> None:
        model_dir = self.context.model_dir
        self.config = config = load_config(model_dir)
        fused_experts_loading(Qwen3OmniMoeTalkerForConditionalGeneration)
        self.model = load_part(
            Qwen3OmniMoeTalkerForConditionalGeneration,
            model_dir,
            config.talker_config,
            dtype=self.dtype,
            device=self.device,
        )
        lend_audio_config(self.model, config)
        tc = config.talker_config
        vocab = int(tc.text_config.vocab_size)
        eos = int(tc.codec_eos_token_id)
        self._generation["eos_token_id"] = eos
        self._generation["suppress_tokens"] = [i for i in range(vocab - SUPPRESSED_TAIL, vocab) if i != eos]
        self._generation.update(generation_overrides(model_dir, "talker", self.args))
        one_at_a_time(self)

    async def warmup(self) -> None:
        c = self.config
        ids = [c.im_start_token_id, c.user_token_id, c.im_end_token_id, c.im_start_token_id, c.assistant_token_id, 0]
        hidden = int(c.talker_config.thinker_hidden_size)
        rows, dtype = rows_to_wire(torch.zeros((len(ids), hidden), dtype=self.model.dtype))
        tensors = {"prompt_rows": rows, "prompt_ids": np.array(ids, dtype=np.int64), "special_rows": rows[:3]}
        speaker = next(iter(c.talker_config.speaker_id.values()))
        await warm_up_talker(self, tensor_frame(PROMPT_KIND, tensors, dtype=dtype, speaker_id=speaker))

    def prepare(self, inp: StageInput, job: OmniJob) -> None:
        if inp.upstream is None:
            raise StageError("the talker takes its input from the thinker stage", status=400)
        job.data["seed"] = request_seed(inp.request)

    def run(self, job: OmniJob) -> None:
        prompt: TensorFrame | None = None
        replies: list[TensorFrame] = []
        for frame in job.upstream():
            if isinstance(frame, TensorFrame) and frame.meta.get("kind") == PROMPT_KIND:
                prompt = frame
            elif isinstance(frame, TensorFrame) and frame.meta.get("kind") == REPLY_KIND:
                replies.append(frame)
            elif isinstance(frame, FinalFrame):
                break
        if prompt is None or not replies:
            # The thinker stopped after one token: nothing to speak (the whole model needs two).
            job.emit(FinalFrame("stop", Usage()))
            return
        inputs = self.inputs(prompt, replies)
        generation = dict(self._generation)
        cap = job.request.params.talker_max_new_tokens
        if cap is not None:
            generation["max_new_tokens"] = min(cap, int(generation["max_new_tokens"]))
        turn = RngTurn(self.device, job.data["seed"])
        criterion = _Stop(self, job, turn, eos=int(generation["eos_token_id"]))
        model = self.model

        def codes(module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
            # A decode step's input carries the previous step's code with its residual codes (the code
            # predictor's draws): that whole frame goes to code2wav.
            residual = kwargs.get("residual_codes")
            if residual is not None:
                criterion.count += 1
                self.context.metrics.add_generated_tokens(1)
                job.emit(tensor_frame(CODES_KIND, {"codes": residual[0].to("cpu", torch.int64).numpy()}))
            turn.begin()

        hooks = [
            # The code predictor draws (from the global generator) before the talker's own forward.
            model.code_predictor.register_forward_pre_hook(lambda *_: turn.begin()),
            model.register_forward_hook(codes, with_kwargs=True),
        ]
        try:
            with warnings.catch_warnings():
                # What the whole model does: its talker gets only inputs_embeds, so the repetition penalty
                # counts the codes it generates, not the prompt (transformers warns about that every call).
                warnings.filterwarnings("ignore", message="Passing `repetition_penalty` with `inputs_embeds`")
                with sdpa_scope(self.prefill_attention):
                    generate(
                        model,
                        **inputs,
                        stopping_criteria=StoppingCriteriaList([criterion]),
                        output_hidden_states=True,
                        return_dict_in_generate=True,
                        **generation,
                    )
        finally:
            for hook in hooks:
                hook.remove()
            turn.end()
        prompt_len = int(inputs["inputs_embeds"].shape[1])
        job.emit(FinalFrame(criterion.reason, Usage(prompt_tokens=prompt_len, completion_tokens=criterion.count)))

    def inputs(self, prompt: TensorFrame, replies: list[TensorFrame]) -> dict[str, torch.Tensor]:
        """The whole model's talker inputs (its ``generate()`` steps 2, batch of one) from the thinker's rows
        of the prompt (input embeddings; at audio/image/video placeholders layer ``accept_hidden_layer``'s hidden
        states) and of every consumed reply token (input embeddings)."""
        c, tc, model, device = self.config, self.config.talker_config, self.model, self.device
        dtype = str(prompt.meta.get("dtype", "float32"))

        def rows(frame: TensorFrame, name: str) -> torch.Tensor:
            return rows_from_wire(frame.tensors[name], dtype, device).to(model.dtype)

        prompt_ids = torch.from_numpy(np.array(prompt.tensors["prompt_ids"], dtype=np.int64)).to(device)
        thinker_embed = torch.cat([rows(prompt, "prompt_rows"), *(rows(f, "rows") for f in replies)]).unsqueeze(0)
        reply_ids = [int(f.tensors["token_ids"][0]) for f in replies]
        input_ids = prompt_ids.unsqueeze(0)
        length = input_ids.shape[1]
        # User turns: every position whose turn (the token after the last <|im_start|>) is "user".
        positions = torch.arange(length, device=device).unsqueeze(0)
        starts = torch.where(input_ids == c.im_start_token_id, positions, positions.new_full((), -1))
        previous = torch.cummax(starts, dim=-1).values.clamp_min(0)
        roles = input_ids.gather(1, (previous + 1).clamp_max(length - 1))
        user_mask = (roles == c.user_token_id)[0]
        # Projected as the whole model projects them: the multimodal positions' hidden states in one batch
        # through hidden_projection, every other prompt position's embedding in one through text_projection
        # (a Linear's rounding can depend on its batch: docs/pipelines/qwen3-omni.md).
        media = torch.isin(
            prompt_ids, torch.tensor([tc.audio_token_id, tc.image_token_id, tc.video_token_id], device=device)
        )
        prompt_rows = thinker_embed[0, :length]
        projected = torch.empty((length, tc.text_config.hidden_size), device=device, dtype=model.dtype)
        if media.any():
            projected[media] = model.hidden_projection(prompt_rows[media])
        projected[~media] = model.text_projection(prompt_rows[~media])
        user_embeds = projected[user_mask].unsqueeze(0)
        user_ids = input_ids[:, user_mask]
        # The assistant turn being answered: its <|im_start|>assistant\n, then the reply.
        starts_at = torch.nonzero(
            (input_ids[0, :-1] == c.im_start_token_id) & (input_ids[0, 1:] == c.assistant_token_id)
        )
        if starts_at.numel() == 0:
            raise StageError("the prompt has no assistant turn to speak", status=400)
        start = int(starts_at.flatten()[-1])
        special = model.text_projection(rows(prompt, "special_rows").unsqueeze(0))
        tts_bos, tts_eos, tts_pad = special.chunk(3, dim=1)
        assistant = model.text_projection(thinker_embed[:, start:])
        text_part = torch.cat((assistant[:, :3], tts_pad.expand(1, 4, -1), tts_bos, assistant[:, 3:4]), dim=1)
        codec_ids = torch.tensor(
            [
                [
                    tc.codec_nothink_id,
                    tc.codec_think_bos_id,
                    tc.codec_think_eos_id,
                    int(prompt.meta["speaker_id"]),
                    tc.codec_pad_id,
                    tc.codec_bos_id,
                ]
            ],
            dtype=torch.long,
            device=device,
        )
        codec_part = torch.cat(
            (
                torch.zeros((1, 3, tc.text_config.hidden_size), device=device, dtype=model.dtype),
                model.get_input_embeddings()(codec_ids),
            ),
            dim=1,
        )
        trailing = torch.cat((assistant[:, 4:], tts_eos), dim=1)
        # A reply with <|im_end|> inside it (ignore_eos): the whole model speaks up to it, then pads.
        ends = [j for j, token in enumerate(reply_ids) if token == c.im_end_token_id]
        if ends:
            first = ends[0]
            index = torch.arange(trailing.shape[1], device=device).view(1, -1, 1)
            trailing = torch.where(index > first, tts_pad.to(trailing.dtype), trailing)
            trailing = torch.where(index == first, tts_eos.to(trailing.dtype), trailing)
        embeds = torch.cat((user_embeds, text_part + codec_part), dim=1)
        ids = torch.cat(
            (user_ids, torch.full((1, text_part.shape[1]), c.tts_pad_token_id, dtype=torch.long, device=device)), dim=1
        )
        # The talker's M-RoPE positions of the media: each audio's feature length (a video's track among
        # them), each image's and video's patch grid, each video's seconds per temporal patch (float32, as the
        # processor gives it: it scales the time positions). Not use_audio_in_video: the whole model's
        # generate() hands it to the thinker only, and its talker lays out a video's interleaved track as
        # without it, so the split does the same.
        grids = {
            name: torch.from_numpy(np.array(prompt.tensors[name], dtype=np.int64)).to(device)
            for name in (AUDIO_LENGTHS, IMAGE_GRID, VIDEO_GRID)
            if name in prompt.tensors
        }
        if VIDEO_SECONDS in prompt.tensors:
            seconds = np.array(prompt.tensors[VIDEO_SECONDS], dtype=np.float32)
            grids[VIDEO_SECONDS] = torch.from_numpy(seconds).to(device)
        return {
            "inputs_embeds": embeds,
            "trailing_text_hidden": trailing,
            "tts_pad_embed": tts_pad,
            "talker_input_ids": ids,
            "attention_mask": torch.ones(ids.shape, dtype=torch.long, device=device),
            **grids,
        }


class _Stop(StoppingCriteria):  # type: ignore[misc]  # transformers is untyped here
    """Right after each first-group code is drawn: ends the request's turn on the global generator, stops at
    end-of-speech, checks cancellation. (The code's frame leaves with the next step, with its residuals.)"""

    def __init__(self, engine: Qwen3TalkerEngine, job: OmniJob, turn: RngTurn, *, eos: int) -> None:
        self.engine = engine
        self.job = job
        self.turn = turn
        self.eos = eos
        self.count = 0
        self.reason = "length"

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **_: Any) -> torch.Tensor:
        self.turn.end()
        self.engine.context.metrics.observe_batch(1)
        done = int(input_ids[0, -1]) == self.eos
        if done:
            self.reason = "stop"
        else:
            self.job.check()
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


# ---------------------------------------------------------------- code2wav


class Qwen3Code2WavEngine(OmniEngine):
    """``transformers`` adapter for the ``qwen3-omni-code2wav`` task."""

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        self.model: Any = None
        self._stream_chunk = int(self.args.get("stream_chunk", STREAM_CHUNK))
        self._left = int(self.args.get("left_context", STREAM_CONTEXT))

    def load_part(self) -> None:
        model_dir = self.context.model_dir
        config = load_config(model_dir)
        with quiet_transformers():
            model = Qwen3OmniMoeCode2Wav._from_config(config.code2wav_config)
        # Loaded by prefix, strictly (from_pretrained on the full checkpoint would keep random weights).
        load_prefixed(model, model_dir, "code2wav.")
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        one_at_a_time(self)

    async def warmup(self) -> None:
        codes = tensor_frame(CODES_KIND, {"codes": np.zeros(int(self.model.config.num_quantizers), dtype=np.int64)})
        await self.warm_up_on([codes], StageParams(audio_chunked=False))

    def prepare(self, inp: StageInput, job: OmniJob) -> None:
        if inp.upstream is None:
            raise StageError("code2wav takes its input from the talker stage", status=400)
        speed = inp.request.params.speed
        if speed is not None and speed != 1.0:
            raise StageError("speed is not supported by this model's code2wav", status=400, param="speed")
        chunked = inp.request.params.audio_chunked
        job.data["chunked"] = inp.request.stream if chunked is None else chunked

    def run(self, job: OmniJob) -> None:
        codes: list[np.ndarray] = []
        start = 0  # first code of the next streamed chunk
        chunked: bool = job.data["chunked"]
        for frame in job.upstream():
            if isinstance(frame, FinalFrame):
                break
            if isinstance(frame, TensorFrame) and frame.meta.get("kind") == CODES_KIND:
                codes.append(np.asarray(frame.tensors["codes"], dtype=np.int64))
                # A chunk goes out once its one code of look-ahead has arrived.
                if chunked and len(codes) - start > self._stream_chunk:
                    start = self._voice_chunk(job, codes, start, start + self._stream_chunk, final=False)
        if chunked:
            while start < len(codes):
                start = self._voice_chunk(job, codes, start, min(start + self._stream_chunk, len(codes)), final=True)
        elif codes:
            job.check()
            wav = self.model.chunked_decode(self._window(codes, 0, len(codes)), WHOLE_CHUNK, WHOLE_CONTEXT)
            self._emit(job, wav.reshape(-1))
        job.emit(FinalFrame("stop", Usage(prompt_tokens=len(codes))))

    def _window(self, codes: list[np.ndarray], lo: int, hi: int) -> torch.Tensor:
        """Codes ``[lo, hi)`` as the vocoder's input (1, groups, hi - lo)."""
        return torch.from_numpy(np.stack(codes[lo:hi], axis=1)).unsqueeze(0).to(self.device)

    def _voice_chunk(self, job: OmniJob, codes: list[np.ndarray], start: int, end: int, *, final: bool) -> int:
        """The audio of codes ``[start, end)``: one pass over them with :attr:`_left` codes of left context
        and one of look-ahead (the causal transposed convolutions hold back the samples of a window's last
        code), keeping exactly their samples, so consecutive chunks join without a gap. Returns ``end``."""
        job.check()
        lo, hi = max(0, start - self._left), min(len(codes), end + 1)
        wav = self.model(self._window(codes, lo, hi)).reshape(-1)
        upsample = int(self.model.total_upsample)
        last = end >= len(codes) and final
        self._emit(job, wav[(start - lo) * upsample : None if last else (end - lo) * upsample])
        return end

    def _emit(self, job: OmniJob, wav: torch.Tensor) -> None:
        samples = wav.float().to("cpu").numpy()
        if samples.size:
            job.emit(TensorFrame({"audio": samples}, meta={**AUDIO_META, "sample_rate": SAMPLE_RATE}))
