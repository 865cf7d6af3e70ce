"""SpeechT5 acoustic stage (``tts-acoustic``): text + speaker embedding -> log-mel frames, streamed.

``SpeechT5ForTextToSpeech.generate()`` returns the mel only once the whole utterance is decoded. To hand
mel frames to the vocoder while decoding goes on, this engine runs the same loop itself, one decoder step
at a time, with the model's own modules in the same order (``_generate_speech`` for one utterance:
encoder, then per step the decoder prenet over the whole output so far, one cached decoder step,
``feat_out``, the stop head; the postnet over the result). With the same seed its mel equals
``generate()``'s bit for bit (tests/component/runtime/test_tts_engines.py checks it).

Streaming the postnet: the postnet is a stack of convolutions over the whole spectrogram, so a frame is
final once ``reach`` = layers * (kernel - 1) / 2 frames after it exist; frames are emitted as soon as they
are final, computed over a window that includes ``reach`` frames on each side, which gives the same
values as the whole-utterance postnet. A request with ``stream=False`` gets the whole-utterance postnet
in one frame at the end (exactly ``generate()``'s output).

Concurrency: one worker thread owns the model. Active utterances advance round-robin, one decoder step
each per pass, so a long utterance does not hold back the first audio of one that arrives later. The
decoder prenet applies dropout even in eval (SpeechT5's "consistent dropout"), drawing from the global
RNG of the model's device; each utterance keeps its own RNG state, swapped in around its step, so its
output depends only on its seed (the request's, else the engine's), not on what else is running.
"""

from __future__ import annotations

import contextlib
import logging
import math
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import torch
from transformers import SpeechT5ForTextToSpeech, SpeechT5Tokenizer
from transformers.utils import logging as hf_logging

from omnimodel_runtime.engines.audio import TimeStretch, checked_speed
from omnimodel_runtime.engines.base import EngineContext
from omnimodel_runtime.engines.compat import cache_kwargs, output_cache
from omnimodel_runtime.engines.devices import resolve_device
from omnimodel_runtime.engines.tts.common import (
    DEFAULT_VOICE,
    GenerationBounds,
    load_voices,
    stage_dir,
)
from omnimodel_runtime.engines.worker import Job, WorkerEngine
from omnimodel_runtime.errors import StageError
from omnimodel_runtime.layout import ACOUSTIC_DIR, VOICES_DIR
from omnimodel_runtime.protocol.speech import resolve_voice
from omnimodel_runtime.protocol.stage import (
    QUERY_VOICES,
    FinalFrame,
    ResponseFrame,
    StageInput,
    StageRequest,
    TensorFrame,
    Usage,
)

log = logging.getLogger(__name__)

# Mel frames per hand-off frame while streaming (16 ms of audio each at 16 kHz, hop 256).
DEFAULT_STREAM_FRAMES: Final = 8


class _Rng:
    """Get/set the global RNG state of one device (the prenet's dropout draws from it)."""

    def __init__(self, device: str) -> None:
        self.device = torch.device(device)
        self._module: Any = None if self.device.type == "cpu" else torch.get_device_module(self.device.type)

    def fresh(self, seed: int) -> torch.Tensor:
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        state: torch.Tensor = gen.get_state()
        return state

    def get(self) -> torch.Tensor:
        if self._module is None:
            return torch.get_rng_state()
        state: torch.Tensor = self._module.get_rng_state(self.device)
        return state

    def set(self, state: torch.Tensor) -> None:
        if self._module is None:
            torch.set_rng_state(state)
        else:
            self._module.set_rng_state(state, self.device)


@dataclass(eq=False, kw_only=True)
class _Utterance(Job):
    """One request inside the worker; everything but ``cancelled`` belongs to the worker thread."""

    ids: list[int]
    speaker: np.ndarray
    seed: int
    speed: float
    # Worker-owned decoding state.
    rng: Any = None
    encoder: Any = None
    mask: Any = None
    speaker_t: Any = None
    sequence: Any = None  # (1, steps + 1, bins): the prenet's input, a zero frame then one per step
    past: Any = None
    minlen: int = 0
    maxlen: int = 0
    steps: int = 0
    spectra: list[Any] = field(default_factory=list)  # per step (1, reduction, bins), before the postnet
    final_frames: int = 0  # postnet frames already emitted
    sent: int = 0  # output frames (after the time stretch) already emitted
    stretch: TimeStretch | None = None


class SpeechT5AcousticEngine(WorkerEngine[_Utterance]):
    """``transformers`` adapter for the ``tts-acoustic`` task."""

    def __init__(self, context: EngineContext) -> None:
        super().__init__(context)
        args = dict(context.stage.engine_args)
        self._args = args
        self._device = resolve_device(context.settings.device)
        self._default_seed = int(args.get("seed", 0))
        self._stream_frames = int(args.get("stream_frames", DEFAULT_STREAM_FRAMES))
        self._max_active = int(args.get("max_batch_size", context.settings.max_batch_size))
        self._threads = args.get("threads")
        self._model: Any = None
        self._tokenizer: Any = None
        self._voices: dict[str, np.ndarray] = {}
        self._bounds = GenerationBounds()
        self._max_tokens = 0
        self._reach = 0
        self._rng: _Rng | None = None

    # ------------------------------------------------------------------ event loop side

    async def warmup(self) -> None:
        request = StageRequest(request_id=f"warmup-{secrets.token_hex(4)}", prompt="Warm up.")
        async for _ in self.generate(StageInput(request=request)):
            pass

    @property
    def max_model_len(self) -> int | None:
        """The longest input in tokens (characters, for SpeechT5's character tokenizer)."""
        return self._max_tokens or None

    @property
    def voices(self) -> list[str]:
        return sorted(self._voices)

    async def generate(self, inp: StageInput) -> AsyncIterator[ResponseFrame]:
        self.require_running()
        request = inp.request
        if request.params.query == QUERY_VOICES:
            yield TensorFrame({}, meta={"voices": self.voices, "default": DEFAULT_VOICE})
            yield FinalFrame("stop")
            return
        # Closed explicitly: a caller going away drops the utterance at the worker's next pass, not at
        # garbage collection.
        async with contextlib.aclosing(self.stream(self._utterance(request))) as frames:
            async for frame in frames:
                yield frame

    def _utterance(self, request: StageRequest) -> _Utterance:
        """Validate a speech request (bad input is a 400 naming the field) and tokenize it."""
        text = request.prompt or ""
        if not text.strip():
            raise StageError("the input text is empty", status=400, param="input")
        voice = resolve_voice(request.params.voice, self.voices, DEFAULT_VOICE, param="voice")
        speed = checked_speed(request.params.speed)
        ids: list[int] = self._tokenizer(text).input_ids
        if len(ids) > self._max_tokens:
            raise StageError(
                f"the input is too long: {len(ids)} tokens, this model speaks at most {self._max_tokens} per request",
                status=400,
                param="input",
            )
        seed = request.sampling.seed if request.sampling.seed is not None else self._default_seed
        return _Utterance(request=request, ids=ids, speaker=self._voices[voice], seed=seed, speed=speed)

    # ------------------------------------------------------------------ worker thread

    def worker_mode(self) -> contextlib.AbstractContextManager[Any]:
        return torch.inference_mode()

    def load(self) -> None:
        hf_logging.disable_progress_bar()
        if self._threads is not None:
            torch.set_num_threads(int(self._threads))
        model_dir = self.context.model_dir
        path = stage_dir(model_dir, self._args, ACOUSTIC_DIR)
        self._tokenizer = SpeechT5Tokenizer.from_pretrained(path)
        model = SpeechT5ForTextToSpeech.from_pretrained(path, dtype=torch.float32)
        self._model = model.to(self._device).eval()
        config = model.config
        voices_dir = self._args.get("voices")
        self._voices = load_voices(
            model_dir / str(voices_dir) if voices_dir else model_dir / VOICES_DIR, config.speaker_embedding_dim
        )
        self._bounds = GenerationBounds.load(model_dir, self._args)
        # generate()'s maxlen = encoder length * maxlenratio / reduction decoder steps, each feeding one
        # more position to the prenet's positional encoding (max_speech_positions long).
        by_speech = math.floor(config.max_speech_positions * config.reduction_factor / self._bounds.maxlenratio)
        self._max_tokens = min(config.max_text_positions, by_speech)
        self._reach = config.speech_decoder_postnet_layers * (config.speech_decoder_postnet_kernel - 1) // 2
        self._rng = _Rng(self._device)
        log.info(
            "Loaded %s on %s for stage %s (%d voices, at most %d tokens)",
            path,
            self._device,
            self.stage.name,
            len(self._voices),
            self._max_tokens,
        )

    def serve(self) -> None:
        active: list[_Utterance] = []
        while True:
            self.flush()
            new = self.gather(self._max_active - len(active), block=not active)
            if self.stopping:
                for u in [*active, *new]:
                    self.refuse(u)
                return
            for u in new:
                if not u.cancelled and self._guarded(u, self._begin):
                    active.append(u)
            # Utterances that finished, failed, went away or ran out of time leave the rotation.
            active = [
                u
                for u in active
                if not u.cancelled and not self.drop_if_expired(u) and not self._guarded(u, self._step)
            ]

    def _guarded(self, u: _Utterance, phase: Callable[[_Utterance], bool]) -> bool:
        """Run one phase of ``u``; a failure fails that utterance only (the others go on). Returns the
        phase's result: True when the utterance was set up (``_begin``) or is done (``_step``)."""
        try:
            return phase(u)
        except Exception as err:
            self.fail(u, err)
            # A failed set-up must not join the rotation; a failed step must leave it.
            return phase != self._begin

    def _begin(self, u: _Utterance) -> bool:
        """Encode the text; set up the decoding state exactly as ``_generate_speech`` does."""
        assert self._rng is not None
        model, config = self._model, self._model.config
        ids = torch.tensor([u.ids], dtype=torch.long, device=self._device)
        u.mask = 1 - (ids == config.pad_token_id).int()
        u.encoder = model.speecht5.encoder(input_values=ids, attention_mask=u.mask, return_dict=True).last_hidden_state
        length = u.encoder.size(1)
        u.maxlen = int(length * self._bounds.maxlenratio / config.reduction_factor)
        u.minlen = int(length * self._bounds.minlenratio / config.reduction_factor)
        u.sequence = u.encoder.new_zeros(1, 1, config.num_mel_bins)
        u.speaker_t = torch.from_numpy(u.speaker).to(self._device).unsqueeze(0)
        u.rng = self._rng.fresh(u.seed)
        u.stretch = TimeStretch(u.speed)
        return True

    def _step(self, u: _Utterance) -> bool:
        """One decoder step (two mel frames for the released model); True when the utterance is done."""
        assert self._rng is not None
        model, config = self._model, self._model.config
        bins, reduction = config.num_mel_bins, config.reduction_factor
        saved = self._rng.get()
        self._rng.set(u.rng)
        try:
            hidden = model.speecht5.decoder.prenet(u.sequence, u.speaker_t)
        finally:
            u.rng = self._rng.get()
            self._rng.set(saved)
        decoder = model.speecht5.decoder.wrapped_decoder
        out = decoder(
            hidden_states=hidden[:, -1:],
            attention_mask=None,
            encoder_hidden_states=u.encoder,
            encoder_attention_mask=u.mask,
            **cache_kwargs(decoder, u.past),
            use_cache=True,
            output_attentions=False,
            return_dict=True,
        )
        last = out.last_hidden_state.squeeze(1)
        u.past = output_cache(out)
        spectrum = model.speech_decoder_postnet.feat_out(last).view(1, reduction, bins)
        u.spectra.append(spectrum)
        u.sequence = torch.cat((u.sequence, spectrum[:, -1, :].view(1, 1, bins)), dim=1)
        prob = torch.sigmoid(model.speech_decoder_postnet.prob_out(last))
        u.steps += 1
        self.context.metrics.observe_batch(1)
        finished: str | None = None
        if u.steps >= u.minlen:
            if u.steps >= u.maxlen:
                finished = "length"
            elif float(prob.sum()) >= self._bounds.threshold:
                finished = "stop"
        if finished is not None or u.request.stream:
            self._emit_mel(u, finished=finished is not None)
        if finished is not None:
            self.context.metrics.add_generated_tokens(u.steps)
            self.emit(u, FinalFrame(finished, Usage(prompt_tokens=len(u.ids), completion_tokens=u.steps)))
            return True
        return False

    def _emit_mel(self, u: _Utterance, *, finished: bool) -> None:
        """Emit the postnet frames that became final (all of them at the end)."""
        reduction = self._model.config.reduction_factor
        total = u.steps * reduction
        ready = total if finished else total - self._reach
        if not finished and ready - u.final_frames < self._stream_frames:
            return
        if ready <= u.final_frames:
            return
        # The window starts ``reach`` frames before the first new one (at a step boundary), so every
        # frame kept sees the same inputs as in a whole-utterance postnet.
        first_step = max(0, u.final_frames - self._reach) // reduction
        offset = first_step * reduction
        pre = torch.cat(u.spectra[first_step:], dim=1)
        post_net = self._model.speech_decoder_postnet.postnet(pre)[0]
        mel = post_net[u.final_frames - offset : ready - offset].float().cpu().numpy()
        u.final_frames = ready
        assert u.stretch is not None
        frames = u.stretch.push(mel, final=finished)
        if len(frames) or finished:
            self.emit(u, TensorFrame({"mel": np.ascontiguousarray(frames)}, meta={"start": u.sent}))
            u.sent += len(frames)
