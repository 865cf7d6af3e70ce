"""Waveform encoding shared by every route that returns audio (chat with audio, speech).

Engines hand over float32 mono waveforms in [-1, 1]; clients get 16-bit PCM in a container.
"""

from __future__ import annotations

import io
import wave

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
