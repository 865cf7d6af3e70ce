"""Binary framing of the stage protocol (media type ``application/x-omnimodel-frames``).

A body, in either direction, is a sequence of frames::

    frame   := u32 header_len (big-endian) | header (UTF-8 JSON, header_len bytes) | payload
    header  := {"kind": ..., "data": {...}, "tensors": [{name, dtype, shape, offset, nbytes}], "payload": N}

``payload`` is ``N`` raw bytes holding every tensor of the frame back to back (C order, little-endian,
each starting at a 64-byte-aligned ``offset``). Tensors are never JSON lists of numbers: the decoder
wraps the received bytes with ``np.frombuffer`` without parsing or copying them again, and the encoder
hands the arrays' own buffers to the writer. Decoded arrays are read-only views of the received body.

The decoder is incremental (:class:`FrameDecoder`), so a receiver can act on each frame as soon as its
bytes arrive: token deltas stream to the client, and a downstream stage can consume the rows an upstream
stage streams to it while that stage is still generating.
"""

from __future__ import annotations

import json
import struct
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Mapping
from typing import Any, Final

import numpy as np
from pydantic import ValidationError

from omnimodel_runtime.protocol.stage import (
    ErrorFrame,
    FinalFrame,
    Frame,
    RequestFrame,
    StageRequest,
    TensorFrame,
    TextFrame,
    Usage,
)

MEDIA_TYPE: Final = "application/x-omnimodel-frames"
ALIGN: Final = 64
MAX_HEADER_BYTES: Final = 1024 * 1024
_PREFIX = struct.Struct(">I")

# Only plain numeric dtypes cross the wire: object or structured dtypes from a peer are refused.
DTYPES: Final[Mapping[str, np.dtype[Any]]] = {
    name: np.dtype(name).newbyteorder("<")
    for name in (
        "bool",
        "int8",
        "uint8",
        "int16",
        "uint16",
        "int32",
        "uint32",
        "int64",
        "uint64",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    )
}


class FrameError(ValueError):
    """A frame stream that does not follow the format (truncated, oversized, or inconsistent)."""


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _dtype_name(arr: np.ndarray) -> str:
    name = arr.dtype.name
    if name not in DTYPES:
        raise FrameError(f"dtype {arr.dtype} cannot travel in a frame (allowed: {', '.join(DTYPES)})")
    return name


def encode_frame(frame: Frame) -> list[bytes | memoryview]:
    """Encode ``frame`` as buffers to write in order; tensor buffers are the arrays' own memory."""
    tensors: Mapping[str, np.ndarray] = {}
    data: dict[str, Any]
    if isinstance(frame, RequestFrame):
        kind, data, tensors = "request", frame.request.model_dump(mode="json"), frame.tensors
    elif isinstance(frame, TextFrame):
        kind, data = "text", {"text": frame.text, "token_ids": list(frame.token_ids)}
    elif isinstance(frame, TensorFrame):
        kind, data, tensors = "tensors", {"meta": dict(frame.meta)}, frame.tensors
    elif isinstance(frame, FinalFrame):
        kind = "final"
        data = {
            "finish_reason": frame.finish_reason,
            "prompt_tokens": frame.usage.prompt_tokens,
            "completion_tokens": frame.usage.completion_tokens,
        }
    else:
        kind = "error"
        data = {"message": frame.message, "status": frame.status, "type": frame.type, "param": frame.param}

    specs: list[dict[str, Any]] = []
    buffers: list[memoryview] = []
    offset = 0
    for name, tensor in tensors.items():
        arr = np.asarray(tensor)
        dtype = _dtype_name(arr)
        # Little-endian C order is the wire layout; arrays already in it are sent without a copy.
        # (np.asarray, not ascontiguousarray: the latter turns 0-d arrays into 1-d ones.)
        arr = np.asarray(arr, dtype=DTYPES[dtype], order="C")
        offset = _aligned(offset)
        specs.append({"name": name, "dtype": dtype, "shape": list(arr.shape), "offset": offset, "nbytes": arr.nbytes})
        buffers.append(arr.reshape(-1).view(np.uint8).data)
        offset += arr.nbytes
    header = json.dumps(
        {"kind": kind, "data": data, "tensors": specs, "payload": offset}, separators=(",", ":")
    ).encode()
    parts: list[bytes | memoryview] = [_PREFIX.pack(len(header)), header]
    written = 0
    for spec, buf in zip(specs, buffers, strict=True):
        if spec["offset"] > written:
            parts.append(bytes(spec["offset"] - written))
        parts.append(buf)
        written = spec["offset"] + spec["nbytes"]
    return parts


def encode_frame_bytes(frame: Frame) -> bytes:
    """One frame as a single ``bytes`` (what an ASGI body message or an HTTP chunk carries)."""
    return b"".join(encode_frame(frame))


def encode_frames(frames: Iterable[Frame]) -> bytes:
    """Several frames back to back (a complete body)."""
    return b"".join(encode_frame_bytes(f) for f in frames)


def _decode(header: Mapping[str, Any], payload: bytes) -> Frame:
    kind = header.get("kind")
    data = header.get("data")
    if not isinstance(data, dict):
        raise FrameError("frame header has no 'data' object")
    tensors = _decode_tensors(header.get("tensors", []), payload)
    try:
        if kind == "request":
            return RequestFrame(request=StageRequest.model_validate(data), tensors=tensors)
        if kind == "text":
            return TextFrame(text=str(data["text"]), token_ids=tuple(int(t) for t in data["token_ids"]))
        if kind == "tensors":
            return TensorFrame(tensors=tensors, meta=dict(data.get("meta") or {}))
        if kind == "final":
            usage = Usage(int(data["prompt_tokens"]), int(data["completion_tokens"]))
            return FinalFrame(finish_reason=str(data["finish_reason"]), usage=usage)
        if kind == "error":
            return ErrorFrame(
                message=str(data["message"]),
                status=int(data["status"]),
                type=str(data["type"]),
                param=None if data.get("param") is None else str(data["param"]),
            )
    except (KeyError, TypeError, ValueError, ValidationError) as err:
        raise FrameError(f"malformed {kind} frame: {err}") from None
    raise FrameError(f"unknown frame kind {kind!r}")


def _decode_tensors(specs: Any, payload: bytes) -> dict[str, np.ndarray]:
    if not isinstance(specs, list):
        raise FrameError("'tensors' must be a list")
    out: dict[str, np.ndarray] = {}
    for spec in specs:
        try:
            name, dtype_name = str(spec["name"]), str(spec["dtype"])
            shape = tuple(int(d) for d in spec["shape"])
            offset, nbytes = int(spec["offset"]), int(spec["nbytes"])
        except (KeyError, TypeError, ValueError):
            raise FrameError(f"malformed tensor spec {spec!r}") from None
        dtype = DTYPES.get(dtype_name)
        if dtype is None:
            raise FrameError(f"tensor {name!r} has unsupported dtype {dtype_name!r}")
        if any(d < 0 for d in shape):
            raise FrameError(f"tensor {name!r} has a negative dimension")
        count = int(np.prod(shape, dtype=np.int64))
        if count * dtype.itemsize != nbytes or offset < 0 or offset + nbytes > len(payload):
            raise FrameError(f"tensor {name!r} does not fit its declared shape, dtype and payload")
        out[name] = np.frombuffer(payload, dtype=dtype, count=count, offset=offset).reshape(shape)
    return out


class FrameDecoder:
    """Incremental decoder: feed bytes as they arrive, get back every frame completed so far."""

    def __init__(self, *, max_frame_bytes: int = 1024 * 1024 * 1024) -> None:
        self._buf = bytearray()
        self._max = max_frame_bytes
        self._header: Mapping[str, Any] | None = None
        self._need = 0

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        """Add ``data`` and return the frames it completed (possibly none)."""
        self._buf += data
        frames: list[Frame] = []
        while True:
            if self._header is None:
                if len(self._buf) < _PREFIX.size:
                    return frames
                (hlen,) = _PREFIX.unpack_from(self._buf)
                if hlen > MAX_HEADER_BYTES:
                    raise FrameError(f"frame header of {hlen} bytes exceeds {MAX_HEADER_BYTES}")
                if len(self._buf) < _PREFIX.size + hlen:
                    return frames
                try:
                    header = json.loads(bytes(self._buf[_PREFIX.size : _PREFIX.size + hlen]))
                except (UnicodeDecodeError, json.JSONDecodeError) as err:
                    raise FrameError(f"frame header is not JSON: {err}") from None
                if not isinstance(header, dict):
                    raise FrameError("frame header is not a JSON object")
                payload = header.get("payload", 0)
                if not isinstance(payload, int) or payload < 0:
                    raise FrameError("frame header has an invalid 'payload' length")
                if payload > self._max:
                    raise FrameError(f"frame payload of {payload} bytes exceeds the limit of {self._max}")
                del self._buf[: _PREFIX.size + hlen]
                self._header, self._need = header, payload
            if len(self._buf) < self._need:
                return frames
            # One copy out of the receive buffer; arrays then view this immutable block.
            payload_bytes = bytes(self._buf[: self._need])
            del self._buf[: self._need]
            header, self._header = self._header, None
            frames.append(_decode(header, payload_bytes))

    @property
    def pending(self) -> bool:
        """True when a frame has started but not finished (a stream that ends now was truncated)."""
        return self._header is not None or bool(self._buf)

    def close(self) -> None:
        """Assert that the stream ended on a frame boundary."""
        if self.pending:
            raise FrameError("frame stream ended in the middle of a frame")


def decode_frames(data: bytes, *, max_frame_bytes: int = 1024 * 1024 * 1024) -> list[Frame]:
    """Decode a complete body."""
    decoder = FrameDecoder(max_frame_bytes=max_frame_bytes)
    frames = decoder.feed(data)
    decoder.close()
    return frames


async def aiter_frames(
    chunks: AsyncIterable[bytes], *, max_frame_bytes: int = 1024 * 1024 * 1024
) -> AsyncIterator[Frame]:
    """Frames from a stream of byte chunks, each yielded as soon as its last byte arrives."""
    decoder = FrameDecoder(max_frame_bytes=max_frame_bytes)
    async for chunk in chunks:
        for frame in decoder.feed(chunk):
            yield frame
    decoder.close()
