"""The binary frame codec of the stage protocol."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from omnimodel_runtime.protocol.frames import (
    ALIGN,
    FrameDecoder,
    FrameError,
    decode_frames,
    encode_frame,
    encode_frame_bytes,
    encode_frames,
)
from omnimodel_runtime.protocol.stage import (
    ErrorFrame,
    FinalFrame,
    Frame,
    RequestFrame,
    SamplingParams,
    StageParams,
    StageRequest,
    TensorFrame,
    TextFrame,
    Usage,
)

REQUEST = StageRequest(
    request_id="r-1",
    messages=({"role": "user", "content": "héllo ☃"},),
    sampling=SamplingParams(max_tokens=8, temperature=0.7, top_p=0.9, seed=3, stop=("\n",)),
    deadline=1e9,
    params=StageParams(voice="alto"),
)


def _tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "hidden": rng.standard_normal((3, 5), dtype=np.float32),
        "ids": np.arange(7, dtype=np.int64),
        "mask": np.array([True, False, True]),
        "scalar": np.array(2.5, dtype=np.float64),
        "empty": np.zeros((0, 4), dtype=np.float16),
    }


def _assert_same(a: Frame, b: Frame) -> None:
    assert type(a) is type(b)
    if isinstance(a, RequestFrame | TensorFrame):
        assert isinstance(b, RequestFrame | TensorFrame)
        assert a.tensors.keys() == b.tensors.keys()
        for name, arr in a.tensors.items():
            got = b.tensors[name]
            assert got.dtype == arr.dtype
            assert got.shape == arr.shape
            np.testing.assert_array_equal(got, arr)
        if isinstance(a, RequestFrame):
            assert isinstance(b, RequestFrame)
            assert b.request == a.request
        else:
            assert isinstance(b, TensorFrame)
            assert dict(b.meta) == dict(a.meta)
    else:
        assert a == b


FRAMES: list[Frame] = [
    RequestFrame(request=REQUEST, tensors=_tensors()),
    TextFrame(text="héllo ☃", token_ids=(1, 2, 300000)),
    TextFrame(text=""),
    TensorFrame(tensors=_tensors(), meta={"rows": [0, 3], "final": False}),
    FinalFrame("length", Usage(prompt_tokens=9, completion_tokens=16)),
    ErrorFrame("boom", status=503, type="service_unavailable", param="x"),
]


@pytest.mark.parametrize("frame", FRAMES, ids=lambda f: type(f).__name__)
def test_every_frame_kind_round_trips(frame: Frame) -> None:
    (decoded,) = decode_frames(encode_frame_bytes(frame))
    _assert_same(frame, decoded)


def test_tensors_are_raw_aligned_bytes_not_json_numbers() -> None:
    arr = np.arange(1000, dtype=np.float32)
    data = encode_frame_bytes(TensorFrame(tensors={"a": arr, "b": arr[:3]}))
    (hlen,) = struct.unpack(">I", data[:4])
    header = json.loads(data[4 : 4 + hlen])
    assert len(data) - 4 - hlen == header["payload"]
    specs = {t["name"]: t for t in header["tensors"]}
    assert all(t["offset"] % ALIGN == 0 for t in specs.values())
    payload = data[4 + hlen :]
    assert payload[specs["a"]["offset"] : specs["a"]["offset"] + 4000] == arr.tobytes()
    assert len(data) < 4000 + 1000  # a JSON list of these floats would be several times larger


def test_encoder_hands_over_the_arrays_own_memory() -> None:
    arr = np.arange(64, dtype=np.float32)
    parts = encode_frame(TensorFrame(tensors={"a": arr}))
    views = [p for p in parts if isinstance(p, memoryview)]
    assert len(views) == 1
    assert np.shares_memory(np.frombuffer(views[0], dtype=np.float32), arr)


def test_decoded_arrays_are_read_only_views_of_one_block() -> None:
    (frame,) = decode_frames(encode_frame_bytes(TensorFrame(tensors={"a": np.ones(4), "b": np.zeros(2)})))
    assert isinstance(frame, TensorFrame)
    a, b = frame.tensors["a"], frame.tensors["b"]
    assert not a.flags.writeable

    def owner(arr: np.ndarray) -> object:
        base: object = arr
        while isinstance(base, np.ndarray):
            base = base.base
        return base

    assert isinstance(owner(a), bytes)
    assert owner(a) is owner(b)  # both view the same received payload, nothing was copied per tensor


def test_non_contiguous_and_big_endian_arrays_arrive_as_little_endian_c_order() -> None:
    base = np.arange(24, dtype=">i4").reshape(4, 6)
    view = base[:, ::2].T  # neither contiguous nor native byte order
    (frame,) = decode_frames(encode_frame_bytes(TensorFrame(tensors={"v": view})))
    assert isinstance(frame, TensorFrame)
    got = frame.tensors["v"]
    assert got.dtype == np.dtype("<i4")
    np.testing.assert_array_equal(got, view)


def test_object_arrays_cannot_be_sent() -> None:
    with pytest.raises(FrameError, match="cannot travel"):
        encode_frame_bytes(TensorFrame(tensors={"o": np.array([object()])}))


@given(st.lists(st.integers(min_value=1, max_value=97), min_size=1, max_size=40))
def test_incremental_decoding_is_independent_of_chunking(cuts: list[int]) -> None:
    data = encode_frames(FRAMES)
    decoder = FrameDecoder()
    out: list[Frame] = []
    pos, i = 0, 0
    while pos < len(data):
        size = cuts[i % len(cuts)]
        out.extend(decoder.feed(data[pos : pos + size]))
        pos, i = pos + size, i + 1
    decoder.close()
    assert len(out) == len(FRAMES)
    for a, b in zip(FRAMES, out, strict=True):
        _assert_same(a, b)


def test_each_frame_is_available_as_soon_as_its_bytes_are() -> None:
    first, second = encode_frame_bytes(TextFrame("a")), encode_frame_bytes(TextFrame("b"))
    decoder = FrameDecoder()
    assert decoder.feed(first[:-1]) == []
    assert decoder.feed(first[-1:] + second[:3]) == [TextFrame("a")]
    assert decoder.pending


def _frame_with_header(header: object, payload: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack(">I", len(raw)) + raw + payload


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (encode_frame_bytes(TextFrame("abc"))[:-1], "middle of a frame"),
        (struct.pack(">I", 10**9), "exceeds"),
        (struct.pack(">I", 3) + b"{x}", "not JSON"),
        (_frame_with_header([1, 2]), "not a JSON object"),
        (_frame_with_header({"kind": "text", "data": {"text": "x", "token_ids": []}, "payload": -1}), "payload"),
        (_frame_with_header({"kind": "martian", "data": {}, "payload": 0}), "unknown frame kind"),
        (_frame_with_header({"kind": "final", "data": {"finish_reason": "stop"}, "payload": 0}), "malformed final"),
        (
            _frame_with_header(
                {
                    "kind": "tensors",
                    "data": {},
                    "tensors": [{"name": "a", "dtype": "object", "shape": [1], "offset": 0, "nbytes": 8}],
                    "payload": 8,
                },
                bytes(8),
            ),
            "unsupported dtype",
        ),
        (
            _frame_with_header(
                {
                    "kind": "tensors",
                    "data": {},
                    "tensors": [{"name": "a", "dtype": "float32", "shape": [4], "offset": 0, "nbytes": 16}],
                    "payload": 8,
                },
                bytes(8),
            ),
            "does not fit",
        ),
        (
            _frame_with_header({"kind": "request", "data": {"request_id": ""}, "payload": 0}),
            "malformed request",
        ),
    ],
)
def test_malformed_streams_are_refused_with_a_reason(data: bytes, match: str) -> None:
    with pytest.raises(FrameError, match=match):
        decode_frames(data)


def test_payload_limit_is_enforced_from_the_header() -> None:
    data = encode_frame_bytes(TensorFrame(tensors={"a": np.zeros(1000)}))
    with pytest.raises(FrameError, match="exceeds the limit"):
        FrameDecoder(max_frame_bytes=100).feed(data[:200])
