"""The Qwen2.5-Omni code2wav stage: codec codes in, 24 kHz mono waveform out.

``Qwen2_5OmniToken2WavModel`` = a DiT (flow matching, RK4 over 10 time points, classifier-free guidance)
that turns codes into mel frames (2 per code), then BigVGAN (240 samples per mel frame). Two ways to run it:

- **Whole** (``params.audio_chunked`` false; non-streamed requests): wait for every code, draw the
  initial noise from the talker's final random state and run the DiT and BigVGAN once — the whole model's
  ``generate()`` waveform, bit for bit. This is the reference path.
- **Chunked** (streamed requests): start as soon as a chunk of codes plus look-ahead has arrived, so the
  first audio leaves before the talker (or the thinker) has finished. The DiT runs on a window of codes
  with left context and look-ahead around the chunk, aligned to its attention blocks, from a position-
  consistent noise sequence; BigVGAN runs on the mel with enough context on both sides that chunk seams
  cost nothing (its receptive field is covered, so the vocoder output equals one pass over all mel).
  The DiT's attention reaches one block further per look-ahead layer at each of its 36 evaluations, so
  no practical window reproduces the whole-sequence mel exactly: chunked audio is an approximation of the
  whole path (tolerance measured and stated in docs/pipelines/qwen2.5-omni.md).

Both paths use :func:`sample_mel`, which is the DiT's own ``sample()`` with the initial noise passed in (and
its RK4 solver's arithmetic written out without the solver's host-side comparisons, so that on CUDA a
whole ``sample_mel`` — 36 DiT evaluations — is captured as one CUDA graph per window shape).

Batched serving (``engine_args.batching``, on by default on accelerators) runs the chunks of several
streamed requests that are ready at the same time, with windows of the same length, as one DiT pass
(batch rows are independent: each row's result is its own, up to the rounding of a larger matrix
product); BigVGAN then voices the chunks of that pass as the rows of one batch per mel length, with one
copy to the host. The window shapes every steady stream uses (the first window, then left context + chunk +
look-ahead) are captured at start, and so are BigVGAN's steady chunk shapes; a stream's last window
widens its left context to one of those lengths where it has the codes (else it runs eagerly, as do
time-stretched speech chunks). First windows run before the others, and wait a moment for a stream a
code or two short of its own (``_gathering``), so that streams starting together share one pass.

Speech requests (``/v1/audio/speech``) have no whole-model waveform to reproduce, so both paths draw the
noise from the position-consistent sequence (:class:`PagedNoise`): the whole file and the stream then
differ only by the chunking error. Their ``speed`` time-stretches the DiT's mel before BigVGAN (linear
interpolation, pitch unchanged; the :class:`~omnimodel_runtime.engines.audio.TimeStretch` the ``tts`` preset uses
too, exact in chunks).

This module is the engine and a request's state on either path; the DiT's sampling, noise and chunk geometry
are :mod:`~omnimodel_runtime.engines.omni.code2wav_dit`, the batched path's DiT and BigVGAN runners (CUDA
graphs, compiled blocks) :mod:`~omnimodel_runtime.engines.omni.code2wav_graphs`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import Qwen2_5OmniToken2WavModel

from omnimodel_runtime.engines.audio import TimeStretch, checked_speed
from omnimodel_runtime.engines.base import flag
from omnimodel_runtime.engines.omni.code2wav_dit import (
    CHUNK_DEFAULTS,
    TOKEN2WAV_DEFAULTS,
    ChunkPlan,
    PagedNoise,
    _Window,
    sample_mel,
)
from omnimodel_runtime.engines.omni.code2wav_graphs import MIN_DB, RECOMPILE_LIMIT, _MelRunner, _Vocoder
from omnimodel_runtime.engines.omni.common import (
    AUDIO_META,
    CODES_KIND,
    RNG_KIND,
    SAMPLE_RATE,
    Speakers,
    generation_overrides,
    load_config,
    load_prefixed,
    quiet_transformers,
    request_seed,
    tensor_frame,
    voice_param,
)
from omnimodel_runtime.engines.omni.engine import OmniEngine, OmniJob
from omnimodel_runtime.errors import StageError
from omnimodel_runtime.protocol.stage import (
    FinalFrame,
    ResponseFrame,
    StageInput,
    StageParams,
    TensorFrame,
    Usage,
)

# The DiT's sampling and chunk geometry (code2wav_dit) and the graph runners (code2wav_graphs) have modules
# of their own; their public names stay importable from here.
__all__ = [
    "CHUNK_DEFAULTS",
    "GATHER_CODES",
    "GATHER_S",
    "MIN_DB",
    "RECOMPILE_LIMIT",
    "TOKEN2WAV_DEFAULTS",
    "ChunkPlan",
    "OmniCode2WavEngine",
    "PagedNoise",
    "sample_mel",
]

log = logging.getLogger(__name__)

# First windows wait this long at most for another stream's first window that lacks at most GATHER_CODES
# codes (see OmniCode2WavEngine._gathering).
GATHER_S = 0.015
GATHER_CODES = 2


class OmniCode2WavEngine(OmniEngine):
    """``transformers`` adapter for the ``omni-code2wav`` task (token2wav always runs in float32)."""

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        self.model: Any = None
        self._speakers: Speakers | None = None
        self._options: dict[str, Any] = dict(TOKEN2WAV_DEFAULTS)
        self._plan: ChunkPlan | None = None
        self._hop = 240
        self._mels: _MelRunner | None = None
        self._vocoder: _Vocoder | None = None  # chunked path
        self._gather_from: float | None = None  # when first windows began waiting for a straggler

    @property
    def speakers(self) -> Speakers:
        assert self._speakers is not None, "the engine is not loaded"
        return self._speakers

    def load_part(self) -> None:
        model_dir = self.context.model_dir
        config = load_config(model_dir)
        with quiet_transformers():
            model = Qwen2_5OmniToken2WavModel._from_config(config.token2wav_config)
        # from_pretrained(full checkpoint) would silently keep random weights (its prefix differs).
        load_prefixed(model, model_dir, "token2wav.")
        self.model = model.float().to(self.device).eval()
        self._speakers = Speakers.load(model_dir)
        self._options.update(generation_overrides(model_dir, "token2wav", self.args))
        self._plan = ChunkPlan.from_args(config.token2wav_config.dit_config, self.args)
        self._hop = int(np.prod(config.token2wav_config.bigvgan_config.upsample_rates))
        repeats = int(self.model.code2wav_dit_model.repeats)
        graphed = self._plan.vocoder_frames(repeats) if self.batched and self.graphs else ()
        rows = int(self.args.get("dit_batch", 4))  # a DiT pass's streams are vocoded together
        self._vocoder = _Vocoder(self.model.code2wav_bigvgan_model, self.device, lengths=graphed, max_rows=rows)
        if self.batched:
            self._load_batched()

    def _load_batched(self) -> None:
        assert self._plan is not None
        plan = self._plan
        if torch.device(self.device).type == "cuda" and flag(self.args, "tf32", default=True):
            # The DiT and BigVGAN run in float32 (from bfloat16 weights): TensorFloat-32 matrix products
            # keep more mantissa than the weights have and run several times faster.
            torch.backends.cuda.matmul.allow_tf32 = True
        self._mels = _MelRunner(self, max_rows=int(self.args.get("dit_batch", 4)), graphs=self.graphs)
        self._mels.shapes = plan.windows()
        default = self.speakers[self.speakers.default]
        self._mels.capture_all(int(default["ref_mel"].shape[1]))
        assert self._vocoder is not None
        self._vocoder.capture_all(int(self.model.code2wav_dit_model.mel_dim), self.device)  # its lengths, if any

    async def warmup(self) -> None:
        codes = tensor_frame(CODES_KIND, {"codes": np.zeros(2, dtype=np.int64)})
        await self.warm_up_on([codes], StageParams(audio_chunked=False))

    def prepare(self, inp: StageInput, job: OmniJob) -> None:
        if inp.upstream is None:
            raise StageError("code2wav takes its input from the talker stage", status=400)
        assert self._speakers is not None
        request = inp.request
        voice = self._speakers.resolve(request.params.voice, param=voice_param(request))
        speaker = self._speakers[voice]
        job.data["cond"] = speaker["cond"].float().to(self.device).reshape(1, -1)
        job.data["ref_mel"] = speaker["ref_mel"].float().to(self.device)
        chunked = request.params.audio_chunked
        job.data["chunked"] = request.stream if chunked is None else chunked
        job.data["seed"] = request_seed(request)
        job.data["paged_noise"] = request.params.speak
        job.data["speed"] = checked_speed(request.params.speed)

    def run(self, job: OmniJob) -> None:
        if job.data["chunked"]:
            self._run_chunked(job)
        else:
            self._run_whole(job)

    # ------------------------------------------------------------ whole (exact) path

    def _run_whole(self, job: OmniJob) -> None:
        whole = _Whole()
        for frame in job.upstream():
            if whole.push(frame):
                break
        self._whole(job, whole)

    def _whole(self, job: OmniJob, whole: _Whole) -> None:
        codes, rng = whole.codes, whole.rng
        if codes:
            dit = self.model.code2wav_dit_model
            frames = len(codes) * int(dit.repeats)
            if job.data["paged_noise"]:
                noise = self._paged_noise(job).frames(0, frames)
            else:
                generator = self._noise_generator(job, rng)
                noise = torch.randn([1, frames, dit.mel_dim], generator=generator, device=self.device)
            code_tensor = torch.tensor([codes], dtype=torch.long, device=self.device)
            mel = sample_mel(
                dit, job.data["cond"], job.data["ref_mel"], code_tensor, noise, check=job.check, **self._options
            )
            stretch = self._stretch(job)
            if stretch is not None:
                mel = self._stretched(stretch, mel, final=True)
            self._emit_audio(job, self.model.code2wav_bigvgan_model(mel))
        job.emit(FinalFrame("stop", Usage(prompt_tokens=len(codes))))

    def _paged_noise(self, job: OmniJob) -> PagedNoise:
        assert self._plan is not None
        dit = self.model.code2wav_dit_model
        return PagedNoise(job.data["seed"], self._plan.block * int(dit.repeats), int(dit.mel_dim), self.device)

    @staticmethod
    def _stretch(job: OmniJob) -> TimeStretch | None:
        speed: float = job.data["speed"]
        return None if speed == 1.0 else TimeStretch(speed)

    def _stretched(self, stretch: TimeStretch, mel: torch.Tensor, *, final: bool) -> torch.Tensor:
        """Push mel (1, mel_dim, n) through ``stretch``; the frames it can compute so far, same layout."""
        frames = stretch.push(mel[0].transpose(0, 1).to("cpu").numpy(), final=final)
        return torch.from_numpy(np.ascontiguousarray(frames.T)).unsqueeze(0).to(self.device)

    def _noise_generator(self, job: OmniJob, rng: TensorFrame | None) -> torch.Generator:
        """The whole model draws the DiT's noise right after the talker's last sample: continue the
        talker's stream when it ran on this device type; else (or without it) a stream from the seed."""
        gen = torch.Generator(device=self.device)
        if rng is not None and rng.meta.get("device") == torch.device(self.device).type:
            gen.set_state(torch.from_numpy(np.array(rng.tensors["rng_state"], dtype=np.uint8)))
        else:
            gen.manual_seed(job.data["seed"])
        return gen

    # ------------------------------------------------------------ chunked (streaming) path

    def _run_chunked(self, job: OmniJob) -> None:
        stream = _Chunked(self, job)
        for frame in job.upstream():
            stream.push(frame)
            self._chunks(stream)
            if stream.ended:
                break
        stream.ended = True
        self._chunks(stream)
        job.emit(FinalFrame("stop", Usage(prompt_tokens=len(stream.codes))))

    def _chunks(self, stream: _Chunked) -> None:
        """Every chunk of ``stream`` whose look-ahead has arrived (all that remain once it has ended)."""
        while (window := stream.window()) is not None:
            job = stream.job
            out = sample_mel(
                self.model.code2wav_dit_model,
                job.data["cond"],
                job.data["ref_mel"],
                window.codes.unsqueeze(0),
                window.noise.unsqueeze(0),
                check=job.check,
                **self._options,
            )
            stream.finish(window, out)

    # ------------------------------------------------------------ batched serving

    def advance(self, jobs: list[OmniJob]) -> tuple[list[OmniJob], bool]:
        finished: list[OmniJob] = []
        moved = False
        ready: list[tuple[_Chunked, _Window]] = []
        for job in jobs:
            with self.alone(job, finished):
                frames = job.poll()
                if job.state is None:
                    job.state = _Chunked(self, job) if job.data["chunked"] else _Whole()
                state = job.state
                if isinstance(state, _Whole):
                    complete = any(state.push(frame) for frame in frames) or job.ended
                    if complete:
                        moved = True
                        self._whole(job, state)
                        finished.append(job)
                    continue
                for frame in frames:
                    state.push(frame)
                if job.ended:
                    state.ended = True
                window = state.window()
                if window is not None:
                    ready.append((state, window))
                elif state.done:
                    moved = True
                    job.emit(FinalFrame("stop", Usage(prompt_tokens=len(state.codes))))
                    finished.append(job)
        if self._gathering(ready, jobs):
            return finished, True  # look again at once: _gathering waited for the next frame
        groups: dict[tuple[int, int], list[tuple[_Chunked, _Window]]] = {}
        for state, window in ready:
            key = (int(window.codes.shape[0]), int(state.job.data["ref_mel"].shape[1]))
            groups.setdefault(key, []).append((state, window))
        assert self._mels is not None
        # First windows go first: a stream's first audio waits for nothing else, while the streams already
        # playing have audio in hand (with four streams, a first window used to wait behind three passes).
        for group in sorted(groups.values(), key=lambda g: not any(w.start == 0 for _, w in g)):
            for start in range(0, len(group), self._mels.max_rows):
                part = group[start : start + self._mels.max_rows]
                moved = True
                self.context.metrics.observe_batch(len(part))
                mels = self._mels.run([(s.job, w) for s, w in part])
                voicing: list[_Voicing] = []
                for (state, window), mel in zip(part, mels, strict=True):
                    with self.alone(state.job, finished):
                        item = state.take(window, mel.unsqueeze(0))
                        if item is not None:
                            voicing.append(item)
                # After each pass, not after the round: a first window's audio still waits for no other pass.
                self._voice(voicing, finished)
        return finished, moved

    def _voice(self, items: list[_Voicing], finished: list[OmniJob]) -> None:
        """Vocode several streams' chunks and send each its audio: one vocoder pass and one copy to the host
        per mel length, where one per stream cost a graph replay and a device sync each (16 streams on an
        H100: 16 serial passes a step). A shared pass that fails is retried stream by stream, so that a
        failure ends only the request it belongs to."""
        assert self._vocoder is not None
        groups: dict[int, list[_Voicing]] = {}
        for item in items:
            groups.setdefault(int(item.mel.shape[2]), []).append(item)
        for group in groups.values():
            rows: list[np.ndarray] | None = None
            if len(group) > 1:
                try:
                    rows = list(_host(self._vocoder(torch.cat([item.mel for item in group]))))
                except Exception:
                    log.exception("Vocoding %d streams together failed; vocoding them one by one", len(group))
            for i, item in enumerate(group):
                with self.alone(item.state.job, finished):
                    item.state.send(item, rows[i] if rows is not None else _host(self._vocoder(item.mel))[0])

    def _gathering(self, ready: list[tuple[_Chunked, _Window]], jobs: list[OmniJob]) -> bool:
        """Whether to hold this round's first windows a moment (up to ``GATHER_S``) for another stream whose
        first window lacks a code or two: streams that start together reach their first window a talker
        step or two apart (a row joins the talker's batch when its prefill is done), and one DiT pass
        serves them all for about the cost of one, where the stream that just missed it would wait for a
        whole pass (~0.15 s on an H200) before its own."""
        assert self._plan is not None
        need = (self._plan.first or self._plan.chunk) + self._plan.lookahead
        close = any(
            isinstance(job.state, _Chunked)
            and job.state.chunk_start == 0
            and not job.state.ended
            and 0 < need - len(job.state.codes) <= GATHER_CODES
            for job in jobs
        )
        if not close or not any(window.start == 0 for _, window in ready):
            self._gather_from = None
            return False
        now = time.monotonic()
        if self._gather_from is None:
            self._gather_from = now
        left = GATHER_S - (now - self._gather_from)
        if left > 0:
            self.wait_idle(left)  # the next upstream frame, or the end of the wait
            return True
        self._gather_from = None
        return False

    def _emit_audio(self, job: OmniJob, waveform: torch.Tensor) -> None:
        self._emit_samples(job, _host(waveform).reshape(-1))

    @staticmethod
    def _emit_samples(job: OmniJob, samples: np.ndarray) -> None:
        """Send ``samples`` (host, float32), unless there are none."""
        if samples.size:
            job.emit(TensorFrame({"audio": samples}, meta={**AUDIO_META, "sample_rate": SAMPLE_RATE}))


def _host(waveform: torch.Tensor) -> np.ndarray:
    """A device waveform as float32 samples on the host (the copy waits for the device)."""
    return np.asarray(waveform.detach().float().to("cpu").numpy())


@dataclass
class _Voicing:
    """A stream's mel to vocode and what of its waveform to send (:meth:`_Chunked.take`)."""

    state: _Chunked
    mel: torch.Tensor  # (1, mel_dim, frames): the frames to voice with the vocoder's context around them
    skip: int  # samples of the left context, already sent
    count: int  # samples to send
    ready: int  # mel frames voiced once they are sent


class _Whole:
    """The whole path's input so far: every code, and the talker's final random state."""

    def __init__(self) -> None:
        self.codes: list[int] = []
        self.rng: TensorFrame | None = None

    def push(self, frame: ResponseFrame) -> bool:
        """Take one upstream frame; True at the talker's final frame."""
        if isinstance(frame, TensorFrame) and frame.meta.get("kind") == CODES_KIND:
            self.codes.extend(int(c) for c in frame.tensors["codes"])
        elif isinstance(frame, TensorFrame) and frame.meta.get("kind") == RNG_KIND:
            self.rng = frame
        return isinstance(frame, FinalFrame)


class _Chunked:
    """One streamed request's chunking: codes so far, the mel not vocoded yet, what has been sent."""

    def __init__(self, engine: OmniCode2WavEngine, job: OmniJob) -> None:
        assert engine._plan is not None
        self.engine, self.job, self.plan = engine, job, engine._plan
        dit = engine.model.code2wav_dit_model
        self.repeats = int(dit.repeats)
        self.noise = engine._paged_noise(job)
        self.stretch = engine._stretch(job)
        self.codes: list[int] = []
        self.ended = False
        self.mel = torch.zeros((1, int(dit.mel_dim), 0), device=engine.device)
        self.mel_start = 0  # global index of mel[..., 0] (older frames are dropped once vocoded)
        self.chunk_start = 0  # next chunk's first code
        self.voiced = 0  # mel frames whose audio has been sent
        self.chunks = 0  # chunks run
        self.first_audio = 0.0  # when the first audio left (monotonic clock), 0 before

    def push(self, frame: ResponseFrame) -> None:
        if isinstance(frame, FinalFrame):
            self.ended = True
        elif isinstance(frame, TensorFrame) and frame.meta.get("kind") == CODES_KIND:
            self.codes.extend(int(c) for c in frame.tensors["codes"])

    @property
    def done(self) -> bool:
        return self.ended and self.chunk_start >= len(self.codes)

    def window(self) -> _Window | None:
        """The next chunk's DiT window, once its look-ahead has arrived (or the codes have ended): the first
        chunk's size at the start, else the largest size whose look-ahead is here (all the rest, up to the
        largest size, once the codes have ended)."""
        plan, start, codes = self.plan, self.chunk_start, self.codes
        if start >= len(codes):
            return None
        sizes = plan.sizes or (plan.chunk,)
        waiting = len(codes) - start
        if start == 0:
            size = plan.first or plan.chunk
            if not self.ended and waiting < size + plan.lookahead:
                return None
        elif self.ended:
            size = min(waiting, sizes[-1])
        else:
            fitting = [s for s in sizes if s + plan.lookahead <= waiting]
            if not fitting or fitting[-1] < self._least():
                return None
            size = fitting[-1]
        end = min(start + size, len(codes))
        lo, hi = max(0, start - plan.left), min(len(codes), end + plan.lookahead)
        if self.ended and hi == len(codes):
            # A stream's last window has a length of its own, which would run eagerly (0.6-0.8 s on an H200
            # against ~0.1 s for a captured pass): widen its left context to the next captured length when
            # there are codes for it. More left context only brings the chunk closer to one pass over all.
            wider = [n for n in plan.windows() if hi - lo <= n <= hi]
            if wider:
                lo = hi - min(wider)
        device = self.engine.device
        window = torch.tensor(codes[lo:hi], dtype=torch.long, device=device)
        noise = self.noise.frames(lo * self.repeats, hi * self.repeats)[0]
        return _Window(codes=window, noise=noise, lo=lo, start=start, end=end)

    def _least(self) -> int:
        """The smallest chunk worth running now (:meth:`ChunkPlan.least`)."""
        frame_s = self.engine._hop / SAMPLE_RATE
        lead = self.voiced * frame_s - (time.monotonic() - self.first_audio) if self.first_audio else 0.0
        return self.plan.least(self.chunks, lead, self.repeats * frame_s)

    def finish(self, window: _Window, out: torch.Tensor) -> None:
        """Keep the chunk's mel out of the window's DiT output ``out`` (1, mel_dim, frames), and vocode and
        send what has enough right context (everything at the end): this stream alone."""
        item = self.take(window, out)
        if item is not None:
            assert self.engine._vocoder is not None
            self.send(item, _host(self.engine._vocoder(item.mel))[0])

    def take(self, window: _Window, out: torch.Tensor) -> _Voicing | None:
        """Keep the chunk's mel out of the window's DiT output ``out`` (1, mel_dim, frames); the mel to vocode
        for what has enough right context (everything at the end), or None when nothing has."""
        engine, plan, repeats = self.engine, self.plan, self.repeats
        keep = out[:, :, (window.start - window.lo) * repeats : (window.end - window.lo) * repeats]
        last = self.ended and window.end >= len(self.codes)
        if self.stretch is not None:
            keep = engine._stretched(self.stretch, keep, final=last)
        self.mel = torch.cat([self.mel, keep], dim=2)
        self.chunk_start = window.end
        self.chunks += 1
        total = self.mel_start + self.mel.shape[2]
        ready = total if last else total - plan.vocoder_context
        if ready <= self.voiced:
            return None
        lo_m = max(self.mel_start, self.voiced - plan.vocoder_context)
        hi_m = min(total, ready + plan.vocoder_context)
        return _Voicing(
            state=self,
            mel=self.mel[:, :, lo_m - self.mel_start : hi_m - self.mel_start],
            skip=(self.voiced - lo_m) * engine._hop,
            count=(ready - self.voiced) * engine._hop,
            ready=ready,
        )

    def send(self, item: _Voicing, waveform: np.ndarray) -> None:
        """Send the new audio out of ``waveform`` (host samples), the vocoder's output for ``item.mel``."""
        self.engine._emit_samples(self.job, waveform[item.skip : item.skip + item.count])
        self.first_audio = self.first_audio or time.monotonic()
        self.voiced = item.ready
        # Only the vocoder's left context is needed again.
        drop = max(0, self.voiced - self.plan.vocoder_context - self.mel_start)
        self.mel, self.mel_start = self.mel[:, :, drop:], self.mel_start + drop
