"""Waveform encoding shared by every route that returns audio (chat with audio, speech).

Engines hand over float32 mono waveforms in [-1, 1] at their model's rate; clients get 16-bit PCM in a
container (wav, flac), raw PCM, or a lossy codec (mp3, opus) through libsndfile, a maintained encoder
library. Containers and codecs state their sample rate, so they keep the model's. Raw PCM states none:
OpenAI's is 24 kHz 16-bit mono little-endian, and its clients play it so, so raw PCM is resampled to
:data:`PCM_RATE` (:class:`Resampler`; a no-op for the Qwen-Omni models, which speak at 24 kHz).
"""

from __future__ import annotations

import io
import math
import wave
from collections.abc import Mapping
from typing import Final

import numpy as np

# The rate of OpenAI's raw PCM (speech ``pcm``, chat ``audio.format: pcm16`` and its streamed deltas).
PCM_RATE: Final = 24000
# Half the resampling filter's length, in input samples at the lower of the two rates, and its Kaiser
# window's beta: about 80 dB of stop band with a transition band of a few per cent of the lower Nyquist.
_HALF_TAPS: Final = 16
_KAISER_BETA: Final = 8.0


class Resampler:
    """A streaming resampler from ``source`` Hz to ``target`` Hz: a Kaiser-windowed sinc filter applied
    at each output sample's exact position, with its cut-off at the lower of the two Nyquist rates.

    :meth:`push` returns the samples that the input so far determines and :meth:`flush` the rest; their
    concatenation has ``ceil(len(input) * target / source)`` samples and is the same, bit for bit,
    however the input was cut into pushes (each output sample is the same sequence of float operations),
    so a stream equals the whole response. numpy only: the gateway has no signal-processing library.
    """

    def __init__(self, source: int, target: int) -> None:
        if source <= 0 or target <= 0:
            raise ValueError(f"sample rates must be positive (got {source} and {target})")
        common = math.gcd(source, target)
        self._up, self._down = target // common, source // common
        cutoff = min(1.0, self._up / self._down)  # of the input's Nyquist rate
        self._reach = math.ceil(_HALF_TAPS / cutoff)  # input samples either side of an output
        # Output n sits at input position n * down / up: between inputs floor(.) and floor(.) + 1, at one
        # of ``up`` fractions. Row p holds the weights of inputs floor(.) - reach + 1 ... floor(.) + reach
        # for the fraction p / up.
        offsets = np.arange(-self._reach + 1, self._reach + 1, dtype=np.float64)
        distance = np.arange(self._up, dtype=np.float64)[:, None] / self._up - offsets[None, :]
        window = np.i0(_KAISER_BETA * np.sqrt(np.clip(1.0 - (distance / self._reach) ** 2, 0.0, None)))
        weights = cutoff * np.sinc(cutoff * distance) * window / np.i0(_KAISER_BETA)
        self._weights = weights / weights.sum(axis=1, keepdims=True)  # unit gain at 0 Hz for every phase
        # Received input not yet behind every future output's window; _start is the index of its first
        # sample in the whole input (negative: the zeros before the first sample).
        self._buffer = np.zeros(self._reach, dtype=np.float64)
        self._start = -self._reach
        self._received = 0
        self._emitted = 0

    @property
    def identity(self) -> bool:
        return self._up == self._down

    def push(self, samples: np.ndarray) -> np.ndarray:
        """The output samples that ``samples`` (the next input) completes, float32."""
        samples = np.asarray(samples, dtype=np.float32).reshape(-1)
        if self.identity:
            return samples
        self._buffer = np.concatenate([self._buffer, samples.astype(np.float64)])
        self._received += len(samples)
        # Output n needs inputs up to floor(n * down / up) + reach.
        ready = max(0, -(-(self._received - self._reach) * self._up // self._down))
        return self._emit(ready)

    def flush(self) -> np.ndarray:
        """The remaining output samples, the input taken as silent past its end."""
        if self.identity:
            return np.zeros(0, dtype=np.float32)
        self._buffer = np.concatenate([self._buffer, np.zeros(2 * self._reach, dtype=np.float64)])
        return self._emit(-(-self._received * self._up // self._down))

    def _emit(self, end: int) -> np.ndarray:
        outputs = np.arange(self._emitted, max(end, self._emitted), dtype=np.int64)
        positions = outputs * self._down
        first = positions // self._up - self._reach + 1 - self._start
        phases = positions % self._up
        result = np.zeros(len(outputs), dtype=np.float64)
        # One tap at a time, gathering as it goes (a window per output would be taps times the output's
        # memory); every output sample is the same operations in whatever push it falls.
        for tap in range(self._weights.shape[1]):
            result += self._weights[phases, tap] * self._buffer[first + tap]
        self._emitted += len(outputs)
        # Drop what no later output reads.
        keep = (self._emitted * self._down) // self._up - self._reach + 1 - self._start
        self._buffer, self._start = self._buffer[keep:], self._start + keep
        return result.astype(np.float32)


def resample(waveform: np.ndarray, source: int, target: int) -> np.ndarray:
    """The whole of ``waveform`` at ``target`` Hz (what :class:`Resampler` streams)."""
    resampler = Resampler(source, target)
    return np.concatenate([resampler.push(waveform), resampler.flush()])


def to_pcm16(waveform: np.ndarray) -> bytes:
    """float32 [-1, 1] → little-endian signed 16-bit PCM (clipped, not wrapped)."""
    clipped = np.clip(np.asarray(waveform, dtype=np.float32).reshape(-1), -1.0, 1.0)
    return (clipped * 32767.0).round().astype("<i2").tobytes()


def wav_bytes(waveform: np.ndarray, sample_rate: int) -> bytes:
    """A complete RIFF/WAVE file: mono, 16-bit PCM."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(sample_rate)
        out.writeframes(to_pcm16(waveform))
    return buf.getvalue()


# ---------------------------------------------------------------- response formats of the speech API

# Content types by response format. Opus travels in an Ogg container, as OpenAI's opus output does.
MEDIA_TYPES: Final[Mapping[str, str]] = {
    "wav": "audio/wav",
    "pcm": "audio/pcm",
    "flac": "audio/flac",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg; codecs=opus",
}

# libsndfile (through soundfile) encodes these; (container, subtype) for each.
_SNDFILE_FORMATS: Final[Mapping[str, tuple[str, str]]] = {
    "flac": ("FLAC", "PCM_16"),
    "mp3": ("MP3", "MPEG_LAYER_III"),
    "opus": ("OGG", "OPUS"),
}
# Opus encodes only these sample rates.
OPUS_SAMPLE_RATES: Final = frozenset({8000, 12000, 16000, 24000, 48000})


def unsupported_reason(fmt: str) -> str | None:
    """Why ``fmt`` cannot be produced here, or ``None`` when it can. wav and pcm need nothing; flac, mp3
    and opus need soundfile with a libsndfile build that has the codec; aac has no maintained encoder
    library to rely on, so it is refused rather than produced by hand."""
    if fmt in ("wav", "pcm"):
        return None
    if fmt not in _SNDFILE_FORMATS:
        return f"response_format {fmt!r} is not supported (this server encodes wav, pcm, flac, mp3 and opus)"
    try:
        import soundfile  # noqa: PLC0415  (optional: only flac/mp3/opus need it)
    except (ImportError, OSError) as err:  # OSError: the package is there but libsndfile is not
        return f"response_format {fmt!r} needs the soundfile package with libsndfile ({err})"
    container, subtype = _SNDFILE_FORMATS[fmt]
    if container not in soundfile.available_formats() or subtype not in soundfile.available_subtypes(container):
        return (
            f"response_format {fmt!r} is not supported: libsndfile {soundfile.__libsndfile_version__} "
            f"has no {container}/{subtype} encoder"
        )
    return None


def encoded_rate(sample_rate: int, fmt: str) -> int:
    """The sample rate of ``fmt`` made from audio at ``sample_rate``: raw PCM is OpenAI's 24 kHz, the
    others keep the model's rate (they state it)."""
    return PCM_RATE if fmt == "pcm" else sample_rate


def encode_audio(waveform: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    """``waveform`` (float32 mono in [-1, 1]) as a complete file in ``fmt`` (at :func:`encoded_rate`).
    wav and flac carry exactly the samples of :func:`to_pcm16`, pcm those of the waveform resampled to
    :data:`PCM_RATE`; raises ``ValueError`` for a format that cannot be made."""
    if fmt == "pcm":
        return to_pcm16(resample(waveform, sample_rate, PCM_RATE))
    if fmt == "wav":
        return wav_bytes(waveform, sample_rate)
    reason = unsupported_reason(fmt)
    if reason is not None:
        raise ValueError(reason)
    if fmt == "opus" and sample_rate not in OPUS_SAMPLE_RATES:
        rates = ", ".join(str(r) for r in sorted(OPUS_SAMPLE_RATES))
        raise ValueError(f"opus cannot encode {sample_rate} Hz audio (it takes {rates} Hz); ask for another format")
    import soundfile  # noqa: PLC0415  (checked above)

    container, subtype = _SNDFILE_FORMATS[fmt]
    # FLAC gets the same 16-bit samples as wav/pcm (so it decodes to exactly them); the lossy codecs
    # take the float signal.
    data = np.frombuffer(to_pcm16(waveform), dtype="<i2") if fmt == "flac" else _clipped(waveform)
    buf = io.BytesIO()
    soundfile.write(buf, data, sample_rate, format=container, subtype=subtype)
    return buf.getvalue()


def _clipped(waveform: np.ndarray) -> np.ndarray:
    return np.clip(np.asarray(waveform, dtype=np.float32).reshape(-1), -1.0, 1.0)
