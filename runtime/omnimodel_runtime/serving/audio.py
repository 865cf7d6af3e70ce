"""Waveform encoding shared by every route that returns audio (chat with audio, speech).

Engines hand over float32 mono waveforms in [-1, 1]; clients get 16-bit PCM in a container (wav, flac),
raw PCM, or a lossy codec (mp3, opus) through libsndfile, a maintained encoder library.
"""

from __future__ import annotations

import io
import wave
from collections.abc import Mapping
from typing import Final

import numpy as np


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


def encode_audio(waveform: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    """``waveform`` (float32 mono in [-1, 1]) as a complete file in ``fmt``. Lossless formats carry
    exactly the samples of :func:`to_pcm16`; raises ``ValueError`` for a format that cannot be made."""
    if fmt == "pcm":
        return to_pcm16(waveform)
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
