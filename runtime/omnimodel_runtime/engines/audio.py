"""What every engine that speaks shares, without torch: the speed a request may ask for and the
streaming time-stretch of mel frames that produces it (the tts acoustic stage and omni code2wav).

The stretch is exact by construction: every output value is computed from the same inputs with the same
elementwise operations whether the input arrives at once or in chunks, so a streamed stretch equals the
stretch of the whole utterance.
"""

from __future__ import annotations

import math

import numpy as np

from omnimodel_runtime.errors import StageError
from omnimodel_runtime.protocol.speech import MAX_SPEED, MIN_SPEED


def checked_speed(speed: float) -> float:
    """``speed`` when the time-stretch can produce it; otherwise a 400 naming the ``speed`` field."""
    if not MIN_SPEED <= speed <= MAX_SPEED:
        raise StageError(f"speed must be within [{MIN_SPEED}, {MAX_SPEED}], got {speed}", status=400, param="speed")
    return speed


class TimeStretch:
    """Changes the duration of a mel stream by ``speed`` (2.0 = twice as fast), pitch unchanged.

    Output frame ``j`` is the linear interpolation of the input at position ``j * speed``; for ``T``
    input frames there are ``floor((T - 1) / speed) + 1`` output frames. A frame is emitted as soon as
    both input frames around its position have arrived, with the same arithmetic whichever chunk they
    came in, so a streamed stretch equals the stretch of the whole utterance exactly.
    """

    def __init__(self, speed: float) -> None:
        if not MIN_SPEED <= speed <= MAX_SPEED:
            raise ValueError(f"speed must be within [{MIN_SPEED}, {MAX_SPEED}], got {speed}")
        self.speed = speed
        self._buf: np.ndarray | None = None  # input frames from index self._base on
        self._base = 0
        self._next = 0  # next output frame

    def push(self, frames: np.ndarray, *, final: bool = False) -> np.ndarray:
        """Add input frames ``(n, bins)``; return the output frames that became computable."""
        frames = np.asarray(frames, dtype=np.float32)
        if self.speed == 1.0:
            return frames
        self._buf = frames if self._buf is None else np.concatenate([self._buf, frames])
        available = self._base + len(self._buf)
        if available == 0:
            return frames[:0]
        # Output j needs input floor(x_j) + 1 (its right neighbour) unless the stream ended, when the
        # last frame stands in for it (with weight 0 it does not change the value anyway).
        last = math.floor((available - 1) / self.speed)
        if not final:
            while last >= self._next and math.floor(last * self.speed) > available - 2:
                last -= 1
        if last < self._next:
            return self._buf[:0]
        pos = np.arange(self._next, last + 1, dtype=np.float64) * self.speed
        left = np.floor(pos).astype(np.int64)
        right = np.minimum(left + 1, available - 1)
        weight = (pos - left).astype(np.float32)[:, None]
        a = self._buf[left - self._base]
        b = self._buf[right - self._base]
        out = a + (b - a) * weight
        self._next = last + 1
        # Frames before the next output's left neighbour are no longer needed (at speed > 1 that may
        # be beyond what has arrived: then everything goes).
        keep_from = min(math.floor(self._next * self.speed), available)
        if keep_from > self._base:
            self._buf = self._buf[keep_from - self._base :]
            self._base = keep_from
        result: np.ndarray = out.astype(np.float32, copy=False)
        return result


def resample(waveform: np.ndarray, source_rate: int, target_rate: int) -> np.ndarray:
    """``waveform`` (mono float32) at ``target_rate``: band-limited resampling in the frequency domain
    (what ``scipy.signal.resample`` does; neither scipy nor librosa is a dependency of the runtime). The
    spectrum is cut (or zero-padded) at the new Nyquist frequency, so downsampling does not alias; the
    signal is treated as periodic, which matters only in the few samples at its ends."""
    if source_rate <= 0:
        raise StageError(f"the audio declares a sample rate of {source_rate} Hz", status=400)
    if source_rate == target_rate or waveform.size == 0:
        return waveform
    n_out = max(1, round(waveform.size * target_rate / source_rate))
    spectrum = np.fft.rfft(waveform.astype(np.float64))
    bins = n_out // 2 + 1
    if bins <= spectrum.size:
        spectrum = spectrum[:bins]
    else:
        spectrum = np.concatenate([spectrum, np.zeros(bins - spectrum.size, dtype=spectrum.dtype)])
    out = np.fft.irfft(spectrum, n=n_out) * (n_out / waveform.size)
    return out.astype(np.float32)
