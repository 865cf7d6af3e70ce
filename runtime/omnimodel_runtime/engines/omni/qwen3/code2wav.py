"""The Qwen3-Omni code2wav stage (:class:`Qwen3Code2WavEngine`): ``Qwen3OmniMoeCode2Wav`` (codes -> 24 kHz
waveform, no randomness). Whole path (non-streamed requests): ``chunked_decode(codes, 300, 25)`` as the whole
model; streamed: chunks of ``stream_chunk`` codes as they arrive, each with ``left_context`` codes before it
and one after, joined without gaps (within 1 LSB of one pass; see :data:`STREAM_CHUNK`).

Batched serving (``engine_args.batching``, on by default on accelerators) runs the ready chunks of several
streams whose windows have the same length (streams in step, and every steady window: left context + chunk +
look-ahead) as one pass, up to ``max_batch_size`` windows a pass; the vocoder's rows are independent, so each
stream gets the samples it gets alone (up to the rounding of a larger matrix product). A request on the whole
path runs alone in its step once its last code has arrived.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import torch
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

from omnimodel_runtime.engines.omni.common import (
    AUDIO_META,
    CODES_KIND,
    SAMPLE_RATE,
    load_prefixed,
    quiet_transformers,
    tensor_frame,
)
from omnimodel_runtime.engines.omni.engine import OmniEngine, OmniJob
from omnimodel_runtime.engines.omni.qwen3.common import load_config
from omnimodel_runtime.errors import StageError
from omnimodel_runtime.protocol.stage import FinalFrame, ResponseFrame, StageInput, StageParams, TensorFrame, Usage

WHOLE_CHUNK: Final = 300
WHOLE_CONTEXT: Final = 25
# The streamed path: chunks of 12 codes (0.96 s) with the vocoder's attention window (72 codes, its
# sliding_window) as left context and one code of look-ahead. Measured on the tiny model, 100 codes: within
# 3e-5 of one pass over all codes (1.2e-7 with 100 codes of context), i.e. at most 1 LSB in 16-bit PCM.
STREAM_CHUNK: Final = 12
STREAM_CONTEXT: Final = 72


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
        stream = _Stream()
        for frame in job.upstream():
            stream.push(frame)
            if stream.ended:
                break
            while job.data["chunked"] and (chunk := self._next(stream)) is not None:
                self._voice(job, stream, chunk, self.model(self._window(stream.codes, chunk.lo, chunk.hi)))
        stream.ended = True
        if not job.data["chunked"]:
            self._whole(job, stream)
            return
        while (chunk := self._next(stream)) is not None:
            self._voice(job, stream, chunk, self.model(self._window(stream.codes, chunk.lo, chunk.hi)))
        job.emit(FinalFrame("stop", Usage(prompt_tokens=len(stream.codes))))

    def _whole(self, job: OmniJob, stream: _Stream) -> None:
        """The whole model's waveform of every code (its own ``chunked_decode``), then the final frame."""
        if stream.codes:
            job.check()
            wav = self.model.chunked_decode(
                self._window(stream.codes, 0, len(stream.codes)), WHOLE_CHUNK, WHOLE_CONTEXT
            )
            self._emit(job, wav.reshape(-1))
        job.emit(FinalFrame("stop", Usage(prompt_tokens=len(stream.codes))))

    def _next(self, stream: _Stream) -> _Chunk | None:
        """The next chunk of ``stream`` to voice: ``stream_chunk`` codes once the one code of look-ahead after
        them has arrived, and, once the stream has ended, whatever remains; ``None`` when none is ready. Its
        window has :attr:`_left` codes of left context (fewer at the start) and that one of look-ahead: the
        causal transposed convolutions hold back the samples of a window's last code."""
        start, count = stream.start, len(stream.codes)
        if stream.ended and start < count:
            end = min(start + self._stream_chunk, count)
        elif count - start > self._stream_chunk:
            end = start + self._stream_chunk
        else:
            return None
        return _Chunk(lo=max(0, start - self._left), hi=min(count, end + 1), start=start, end=end, last=end >= count)

    def _voice(self, job: OmniJob, stream: _Stream, chunk: _Chunk, wav: torch.Tensor) -> None:
        """Emit exactly the samples of ``chunk``'s codes from ``wav``, its window's waveform, so consecutive
        chunks join without a gap (the last one keeps the tail)."""
        job.check()
        upsample = int(self.model.total_upsample)
        wav = wav.reshape(-1)
        self._emit(
            job, wav[(chunk.start - chunk.lo) * upsample : None if chunk.last else (chunk.end - chunk.lo) * upsample]
        )
        stream.start = chunk.end

    def _window(self, codes: list[np.ndarray], lo: int, hi: int) -> torch.Tensor:
        """Codes ``[lo, hi)`` as the vocoder's input (1, groups, hi - lo)."""
        return torch.from_numpy(np.stack(codes[lo:hi], axis=1)).unsqueeze(0).to(self.device)

    # ------------------------------------------------------------ batched serving

    def advance(self, jobs: list[OmniJob]) -> tuple[list[OmniJob], bool]:
        finished: list[OmniJob] = []
        moved = False
        ready: dict[int, list[tuple[OmniJob, _Stream, _Chunk]]] = {}  # by window length
        for job in jobs:
            with self.alone(job, finished):
                if job.state is None:
                    job.state = _Stream()
                stream: _Stream = job.state
                for frame in job.poll():
                    stream.push(frame)
                stream.ended = stream.ended or job.ended
                if not job.data["chunked"]:
                    if stream.ended:
                        moved = True
                        self._whole(job, stream)
                        finished.append(job)
                    continue
                chunk = self._next(stream)
                if chunk is not None:
                    ready.setdefault(chunk.hi - chunk.lo, []).append((job, stream, chunk))
                elif stream.ended:
                    moved = True
                    job.emit(FinalFrame("stop", Usage(prompt_tokens=len(stream.codes))))
                    finished.append(job)
        with self.one_wake_up():
            for group in ready.values():
                for first in range(0, len(group), self.max_batch):
                    part = group[first : first + self.max_batch]
                    moved = True
                    self.context.metrics.observe_batch(len(part))
                    windows = torch.cat([self._window(s.codes, c.lo, c.hi) for _, s, c in part])
                    wavs = self.model(windows)
                    for (job, stream, chunk), wav in zip(part, wavs, strict=True):
                        with self.alone(job, finished):
                            self._voice(job, stream, chunk, wav)
        return finished, moved

    def _emit(self, job: OmniJob, wav: torch.Tensor) -> None:
        samples = wav.float().to("cpu").numpy()
        if samples.size:
            job.emit(TensorFrame({"audio": samples}, meta={**AUDIO_META, "sample_rate": SAMPLE_RATE}))


@dataclass
class _Stream:
    """One request's codes so far (a ``(groups,)`` array each) and the first code not voiced yet."""

    codes: list[np.ndarray] = field(default_factory=list)
    start: int = 0
    ended: bool = False  # the talker's final frame (or the feed's end) has arrived

    def push(self, frame: ResponseFrame) -> None:
        if isinstance(frame, FinalFrame):
            self.ended = True
        elif isinstance(frame, TensorFrame) and frame.meta.get("kind") == CODES_KIND:
            self.codes.append(np.asarray(frame.tensors["codes"], dtype=np.int64))


@dataclass(frozen=True)
class _Chunk:
    """Codes ``[start, end)`` to voice, from one pass over the window ``[lo, hi)``; ``last``: the stream's end."""

    lo: int
    hi: int
    start: int
    end: int
    last: bool
