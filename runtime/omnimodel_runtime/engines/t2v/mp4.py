"""Frames → an MP4 file with PyAV (H.264, yuv420p: what browsers and players take without asking)."""

from __future__ import annotations

import io
from fractions import Fraction
from typing import Final

import av
import numpy as np

# x264's default quality; 0 would be lossless but most players cannot show 4:4:4 lossless streams.
CRF: Final = 18


def encode_mp4(frames: np.ndarray, fps: int) -> bytes:
    """A uint8 ``(frames, height, width, 3)`` RGB video as the bytes of an MP4 file at ``fps``. The sides
    must be even (yuv420p halves the chroma planes); the engine only makes multiples of 16."""
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[3] != 3:
        raise ValueError(f"MP4 encoding needs uint8 (frames, H, W, 3) pixels, got {frames.dtype} {frames.shape}")
    count, height, width, _ = frames.shape
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=Fraction(fps, 1))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"crf": str(CRF)}
        for index in range(count):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(frames[index]), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return buffer.getvalue()
