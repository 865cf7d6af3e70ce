"""The Qwen3-Omni code2wav stage (:class:`Qwen3Code2WavEngine`): ``Qwen3OmniMoeCode2Wav`` (codes -> 24 kHz
waveform, no randomness). Whole path (non-streamed requests): ``chunked_decode(codes, 300, 25)`` as the whole
model; streamed: chunks of ``stream_chunk`` codes as they arrive, each with ``left_context`` codes before it
and one after, joined without gaps (within 1 LSB of one pass; see :data:`STREAM_CHUNK`)."""

from __future__ import annotations

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
from omnimodel_runtime.engines.omni.qwen3.common import load_config, one_at_a_time
from omnimodel_runtime.errors import StageError
from omnimodel_runtime.protocol.stage import FinalFrame, StageInput, StageParams, TensorFrame, Usage

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
