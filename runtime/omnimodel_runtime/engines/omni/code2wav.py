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

Both paths use :func:`sample_mel`, which is the DiT's own ``sample()`` with the initial noise passed in.

Speech requests (``/v1/audio/speech``) have no whole-model waveform to reproduce, so both paths draw the
noise from the position-consistent sequence (:class:`PagedNoise`): the whole file and the stream then
differ only by the chunking error. Their ``speed`` time-stretches the DiT's mel before BigVGAN (linear
interpolation, pitch unchanged; the :class:`~omnimodel_runtime.engines.audio.TimeStretch` the ``tts`` preset uses
too, exact in chunks).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import Qwen2_5OmniToken2WavModel
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import RungeKutta4ODESolver

from omnimodel_runtime.engines.audio import TimeStretch, checked_speed
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
from omnimodel_runtime.protocol.stage import FinalFrame, StageInput, StageParams, StageRequest, TensorFrame, Usage

# The whole model's token2wav defaults.
TOKEN2WAV_DEFAULTS: dict[str, Any] = {"num_steps": 10, "guidance_scale": 0.5, "sway_coefficient": -1.0}
# Chunking, in DiT attention blocks (24 mel frames = 12 codes = 0.24 s each, at the released geometry):
# a chunk of 2 blocks with 2 blocks of left context and 1 block of look-ahead (vLLM-Omni's geometry); the
# vocoder gets 24 mel frames of context on each side, which covers BigVGAN's receptive field at the
# released kernel and dilation sizes (16 already makes chunked vocoding equal one pass to ~1e-6).
CHUNK_DEFAULTS: dict[str, int] = {"chunk_blocks": 2, "left_blocks": 2, "lookahead_blocks": 1, "vocoder_context": 24}


def sample_mel(
    dit: Any,
    cond: torch.Tensor,
    ref_mel: torch.Tensor,
    codes: torch.Tensor,
    noise: torch.Tensor,
    *,
    num_steps: int = 10,
    guidance_scale: float = 0.5,
    sway_coefficient: float | None = -1.0,
    check: Any = None,
) -> torch.Tensor:
    """``Qwen2_5OmniToken2WavDiTModel.sample()`` starting from ``noise`` (1, 2·codes, mel_dim) instead of
    drawing it from the global generator; returns mel (1, mel_dim, frames). ``check`` runs before every
    DiT evaluation (cancellation)."""
    frames = noise.shape[1]
    if frames > dit.config.max_position_embeddings:
        raise StageError(
            f"{frames} mel frames exceed the DiT's limit of {dit.config.max_position_embeddings}", status=400
        )
    cond = cond.unsqueeze(1).repeat(1, frames, 1)

    def ode_function(time_step: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        if check is not None:
            check()
        if guidance_scale < 1e-5:
            out: torch.Tensor = dit(
                hidden_states=hidden_states,
                speaker_embedding=cond,
                condition_vector=ref_mel,
                quantized_code=codes,
                time_step=time_step,
                drop_audio_conditioning=False,
                drop_code=False,
                apply_cfg=False,
            )
            return out
        output = dit(
            hidden_states=hidden_states,
            quantized_code=codes,
            speaker_embedding=cond,
            condition_vector=ref_mel,
            time_step=time_step,
            apply_cfg=True,
        )
        guided, null = torch.chunk(output, 2, dim=0)
        return guided + (guided - null) * guidance_scale

    times = torch.linspace(0, 1, num_steps, device=codes.device, dtype=cond.dtype)
    if sway_coefficient is not None:
        times += sway_coefficient * (torch.cos(torch.pi / 2 * times) - 1 + times)
    trajectory = RungeKutta4ODESolver(function=ode_function, initial_value=noise).integrate(times)
    mel: torch.Tensor = trajectory[-1].permute(0, 2, 1)
    return mel


class PagedNoise:
    """A position-consistent noise sequence drawn in pages of one DiT block: frame i has the same noise
    whichever window asks for it, so neighbouring chunks agree where their windows overlap."""

    def __init__(self, seed: int, page: int, mel_dim: int, device: str) -> None:
        self._gen = torch.Generator(device=device)
        self._gen.manual_seed(seed)
        self._page, self._dim, self._device = page, mel_dim, device
        self._pages: list[torch.Tensor] = []

    def frames(self, start: int, end: int) -> torch.Tensor:
        while len(self._pages) * self._page < end:
            self._pages.append(
                torch.randn([1, self._page, self._dim], generator=self._gen, device=self._device, dtype=torch.float32)
            )
        return torch.cat(self._pages, dim=1)[:, start:end]


@dataclass
class ChunkPlan:
    """Chunk geometry in codes (one DiT block = ``block`` codes) and vocoder context in mel frames."""

    block: int
    chunk: int
    left: int
    lookahead: int
    vocoder_context: int

    @classmethod
    def from_args(cls, dit_config: Any, args: dict[str, Any]) -> ChunkPlan:
        values = {**CHUNK_DEFAULTS, **{k: int(v) for k, v in args.items() if k in CHUNK_DEFAULTS}}
        block = max(1, int(dit_config.block_size) // int(dit_config.repeats))
        return cls(
            block=block,
            chunk=block * max(1, values["chunk_blocks"]),
            left=block * values["left_blocks"],
            lookahead=block * values["lookahead_blocks"],
            vocoder_context=values["vocoder_context"],
        )


class OmniCode2WavEngine(OmniEngine):
    """``transformers`` adapter for the ``omni-code2wav`` task (token2wav always runs in float32)."""

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        self.model: Any = None
        self._speakers: Speakers | None = None
        self._options: dict[str, Any] = dict(TOKEN2WAV_DEFAULTS)
        self._plan: ChunkPlan | None = None
        self._hop = 240

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

    async def warmup(self) -> None:
        async def upstream() -> Any:
            yield tensor_frame(CODES_KIND, {"codes": np.zeros(2, dtype=np.int64)})
            yield FinalFrame("stop")

        request = StageRequest(
            request_id=f"warmup-{secrets.token_hex(4)}", prompt="", params=StageParams(audio_chunked=False)
        )
        async for _ in self.generate(StageInput(request=request, upstream=upstream())):
            pass

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
        codes: list[int] = []
        rng: TensorFrame | None = None
        for frame in job.upstream():
            if isinstance(frame, TensorFrame) and frame.meta.get("kind") == CODES_KIND:
                codes.extend(int(c) for c in frame.tensors["codes"])
            elif isinstance(frame, TensorFrame) and frame.meta.get("kind") == RNG_KIND:
                rng = frame
            elif isinstance(frame, FinalFrame):
                break
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
        assert self._plan is not None
        plan = self._plan
        dit, vocoder = self.model.code2wav_dit_model, self.model.code2wav_bigvgan_model
        repeats = int(dit.repeats)
        noise = self._paged_noise(job)
        stretch = self._stretch(job)
        codes: list[int] = []
        mel = torch.zeros((1, int(dit.mel_dim), 0), device=self.device)
        mel_start = 0  # global index of mel[..., 0] (older frames are dropped once vocoded)
        chunk_start = 0  # next chunk's first code
        voiced = 0  # mel frames whose audio has been sent
        ended = False
        frames = job.upstream()
        while True:
            if not ended:
                frame = next(frames, None)
                if frame is None or isinstance(frame, FinalFrame):
                    ended = True
                elif isinstance(frame, TensorFrame) and frame.meta.get("kind") == CODES_KIND:
                    codes.extend(int(c) for c in frame.tensors["codes"])
            # Every chunk whose look-ahead has arrived (all that remain once the talker has finished).
            while chunk_start < len(codes) and (ended or len(codes) >= chunk_start + plan.chunk + plan.lookahead):
                end = min(chunk_start + plan.chunk, len(codes))
                lo, hi = max(0, chunk_start - plan.left), min(len(codes), end + plan.lookahead)
                window = torch.tensor([codes[lo:hi]], dtype=torch.long, device=self.device)
                y0 = noise.frames(lo * repeats, hi * repeats)
                out = sample_mel(
                    dit, job.data["cond"], job.data["ref_mel"], window, y0, check=job.check, **self._options
                )
                keep = out[:, :, (chunk_start - lo) * repeats : (end - lo) * repeats]
                last = ended and end >= len(codes)
                if stretch is not None:
                    keep = self._stretched(stretch, keep, final=last)
                mel = torch.cat([mel, keep], dim=2)
                chunk_start = end
                # Vocode what has enough right context (everything at the end).
                total = mel_start + mel.shape[2]
                ready = total if last else total - plan.vocoder_context
                if ready > voiced:
                    lo_m = max(mel_start, voiced - plan.vocoder_context)
                    hi_m = min(total, ready + plan.vocoder_context)
                    audio = vocoder(mel[:, :, lo_m - mel_start : hi_m - mel_start]).reshape(-1)
                    skip = (voiced - lo_m) * self._hop
                    self._emit_audio(job, audio[skip : skip + (ready - voiced) * self._hop])
                    voiced = ready
                    # Only the vocoder's left context is needed again.
                    drop = max(0, voiced - plan.vocoder_context - mel_start)
                    mel, mel_start = mel[:, :, drop:], mel_start + drop
            if ended and chunk_start >= len(codes):
                break
        job.emit(FinalFrame("stop", Usage(prompt_tokens=len(codes))))

    def _emit_audio(self, job: OmniJob, waveform: torch.Tensor) -> None:
        samples = waveform.detach().reshape(-1).float().to("cpu").numpy()
        if samples.size:
            job.emit(TensorFrame({"audio": samples}, meta={**AUDIO_META, "sample_rate": SAMPLE_RATE}))
