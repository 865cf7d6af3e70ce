"""HiFi-GAN vocoder stage (``tts-vocoder``): log-mel frames from the acoustic stage -> waveform, streamed.

With ``stream=True`` the vocoder starts on the first mel chunk instead of waiting for the utterance: it
vocodes chunk by chunk as frames arrive (see :class:`~omnimodel_runtime.engines.tts.common.ChunkPlan`),
each over a window that carries HiFi-GAN's receptive field on both sides, so chunks join without seams.
The concatenated chunks equal the whole-utterance waveform up to float rounding of the convolutions over
different window lengths (measured: < 2e-6, at most 1 LSB after 16-bit quantisation). With
``stream=False`` it vocodes the whole mel once, exactly as ``SpeechT5HifiGan(mel)`` / ``generate(vocoder=)``.

Frames out: ``TensorFrame({"audio": float32 samples}, meta={"modality": "audio", "sample_rate", "start"})``.
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Final

import numpy as np
import torch
from transformers import SpeechT5HifiGan
from transformers.utils import logging as hf_logging

from omnimodel_runtime.engines.base import EngineContext
from omnimodel_runtime.engines.devices import resolve_device
from omnimodel_runtime.engines.tts.common import (
    ChunkPlan,
    ChunkWindow,
    hifigan_context_frames,
    stage_dir,
)
from omnimodel_runtime.engines.worker import Job, WorkerEngine
from omnimodel_runtime.errors import StageError
from omnimodel_runtime.layout import VOCODER_DIR
from omnimodel_runtime.protocol.stage import FinalFrame, ResponseFrame, StageInput, StageRequest, TensorFrame, Usage

log = logging.getLogger(__name__)

# First chunk 16 mel frames (256 ms at 16 kHz), doubling up to 128 (about 2 s).
DEFAULT_FIRST_CHUNK: Final = 16
DEFAULT_LARGEST_CHUNK: Final = 128


@dataclass(eq=False, kw_only=True)
class _Vocode(Job):
    """One vocoder pass of a request (a window of its mel, or all of it): the worker answers with one
    audio frame. Requests stream window by window, so concurrent requests take turns on the worker."""

    audio: Callable[[], TensorFrame]


class HifiGanVocoderEngine(WorkerEngine[_Vocode]):
    """``transformers`` adapter for the ``tts-vocoder`` task."""

    def __init__(self, context: EngineContext) -> None:
        super().__init__(context)
        args = dict(context.stage.engine_args)
        self._args = args
        self._device = resolve_device(context.settings.device)
        self._first = int(args.get("first_chunk_frames", DEFAULT_FIRST_CHUNK))
        self._largest = int(args.get("largest_chunk_frames", DEFAULT_LARGEST_CHUNK))
        self._context_arg = args.get("context_frames")
        self._threads = args.get("threads")
        self._model: Any = None
        self.sample_rate = 0
        self.hop = 0
        self.context_frames = 0
        self.num_mel_bins = 0

    async def warmup(self) -> None:
        mel = np.zeros((4, self.num_mel_bins), dtype=np.float32)
        request = StageRequest(request_id=f"warmup-{secrets.token_hex(4)}")
        await self.result(_Vocode(request=request, audio=lambda: self._audio(self._vocode(mel), 0)))

    def load(self) -> None:
        hf_logging.disable_progress_bar()
        if self._threads is not None:
            torch.set_num_threads(int(self._threads))
        path = stage_dir(self.context.model_dir, self._args, VOCODER_DIR)
        model = SpeechT5HifiGan.from_pretrained(path, dtype=torch.float32)
        self._model = model.to(self._device).eval()
        config = model.config
        self.sample_rate = int(config.sampling_rate)
        self.hop = math.prod(config.upsample_rates)
        self.num_mel_bins = int(config.model_in_dim)
        self.context_frames = (
            int(self._context_arg)
            if self._context_arg is not None
            else hifigan_context_frames(
                upsample_rates=config.upsample_rates,
                upsample_kernel_sizes=config.upsample_kernel_sizes,
                resblock_kernel_sizes=config.resblock_kernel_sizes,
                resblock_dilation_sizes=config.resblock_dilation_sizes,
            )
        )
        ChunkPlan(first=self._first, largest=self._largest, context=self.context_frames)  # validates the args
        log.info(
            "Loaded %s on %s for stage %s (%d Hz, chunk context %d frames)",
            path,
            self._device,
            self.stage.name,
            self.sample_rate,
            self.context_frames,
        )

    def _vocode(self, mel: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            spectrogram = torch.from_numpy(mel).to(self._device)
            # An un-batched (frames, bins) spectrogram gives an un-batched waveform (docs/reference/PIPELINE-NOTES.md).
            wave = self._model(spectrogram)
            out: np.ndarray = wave.float().cpu().numpy()
            return out

    async def generate(self, inp: StageInput) -> AsyncIterator[ResponseFrame]:
        self.require_running()
        if inp.upstream is None:
            raise StageError(f"stage {self.stage.name!r} turns mel frames into audio; it needs an upstream stage")
        stream = inp.request.stream
        plan = ChunkPlan(first=self._first, largest=self._largest, context=self.context_frames)
        parts: list[np.ndarray] = []
        mel = np.zeros((0, self.num_mel_bins), dtype=np.float32)
        finished = False
        samples = 0
        async for frame in inp.upstream:
            if isinstance(frame, TensorFrame) and "mel" in frame.tensors:
                chunk = np.asarray(frame.tensors["mel"], dtype=np.float32)
                if chunk.ndim != 2 or chunk.shape[1] != self.num_mel_bins:
                    raise StageError(
                        f"expected mel frames of shape (n, {self.num_mel_bins}), got {tuple(chunk.shape)}", status=500
                    )
                parts.append(chunk)
            elif isinstance(frame, FinalFrame):
                finished = True
            if parts:
                mel = np.concatenate([mel, *parts])
                parts.clear()
            if not stream:
                continue
            while (window := plan.next(len(mel), finished=finished)) is not None:
                audio = await self._pass(inp.request, partial(self._window, mel, window), samples)
                yield audio
                samples += len(audio.tensors["audio"])
        if not finished:
            raise StageError("the acoustic stage ended without finishing the utterance", status=502)
        if not stream and len(mel):
            audio = await self._pass(inp.request, lambda: self._vocode(mel), samples)
            yield audio
            samples += len(audio.tensors["audio"])
        yield FinalFrame("stop", Usage(completion_tokens=samples))

    async def _pass(self, request: StageRequest, vocode: Callable[[], np.ndarray], start: int) -> TensorFrame:
        """One vocoder pass on the worker: its audio, as the frame that starts at sample ``start``."""
        frame = await self.result(_Vocode(request=request, audio=lambda: self._audio(vocode(), start)))
        assert isinstance(frame, TensorFrame)
        return frame

    def serve(self) -> None:
        while (job := self.take()) is not None:
            if job.cancelled:
                continue
            try:
                self.emit(job, job.audio())
            except Exception as err:
                self.fail(job, err)
            self.flush()

    def _window(self, mel: np.ndarray, w: ChunkWindow) -> np.ndarray:
        wave = self._vocode(np.ascontiguousarray(mel[w.lo : w.hi]))
        return wave[(w.start - w.lo) * self.hop : (w.end - w.lo) * self.hop]

    def _audio(self, audio: np.ndarray, start: int) -> TensorFrame:
        return TensorFrame(
            {"audio": np.ascontiguousarray(audio, dtype=np.float32)},
            meta={"modality": "audio", "sample_rate": self.sample_rate, "start": start},
        )
