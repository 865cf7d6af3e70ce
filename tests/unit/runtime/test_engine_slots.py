"""Shape bookkeeping of batched decoding: step buckets, slot compaction, code2wav's chunk geometry."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest

from omnimodel_runtime.engines.omni.code2wav import ChunkPlan
from omnimodel_runtime.engines.omni.engine import WorkClock
from omnimodel_runtime.engines.slots import SlotTable, bucket, buckets


def test_buckets_double_up_to_the_limit() -> None:
    assert buckets(8) == [1, 2, 4, 8]
    assert buckets(6) == [1, 2, 4, 6]
    assert buckets(4096, 256) == [256, 512, 1024, 2048, 4096]
    assert bucket(3, [1, 2, 4, 8]) == 4
    assert bucket(8, [1, 2, 4, 8]) == 8
    with pytest.raises(ValueError, match="exceeds"):
        bucket(9, [1, 2, 4, 8])


class _Decoder:
    slots = 4

    def __init__(self) -> None:
        self.moves: list[tuple[int, int, int]] = []

    def move(self, src: int, dst: int, length: int) -> None:
        self.moves.append((src, dst, length))


class _Row:
    def __init__(self, length: int) -> None:
        self.length = length


def test_a_leaving_request_s_slot_is_filled_by_the_last_one() -> None:
    decoder = _Decoder()
    table = SlotTable(decoder)  # type: ignore[arg-type]
    rows: list[Any] = [_Row(10), _Row(20), _Row(30)]
    assert [table.take(r) for r in rows] == [0, 1, 2]
    assert table.free == 1
    moved = table.release(rows[0], lambda r: int(r.length))
    # c (slot 2, 30 positions) moves into slot 0; the held slots stay 0..n-1.
    assert decoder.moves == [(2, 0, 30)]
    assert moved == {rows[2]: 0}
    assert table.holders == [rows[2], rows[1]]
    assert table.release(rows[1], lambda r: int(r.length)) == {}  # the last one leaves: nothing moves
    assert table.holders == [rows[2]]


def test_chunk_geometry_of_the_released_dit() -> None:
    dit = SimpleNamespace(block_size=24, repeats=2)  # 12 codes a block
    plan = ChunkPlan.from_args(dit, {})
    assert (plan.block, plan.first, plan.chunk, plan.left, plan.lookahead) == (12, 24, 24, 24, 12)
    assert plan.sizes == (24, 48, 96)  # a stream that is behind doubles its chunk up to 8 blocks
    # First window, second (left context = the first chunk), steady ones.
    assert plan.windows() == {36, 60, 84, 132}
    # The vocoder's mel (2 frames a code, 24 frames of context): the first chunk's, then chunk + context.
    assert plan.vocoder_frames(2) == {48, 96, 144, 240}
    small = ChunkPlan.from_args(dit, {"max_chunk_blocks": 2, "first_chunk_blocks": 1})
    assert small.sizes == (24,)
    assert small.windows() == {24, 48, 60}
    assert small.vocoder_frames(2) == {72, 96}  # a 1-block first chunk is all right context: nothing to vocode


def test_a_stream_ahead_of_real_time_waits_for_larger_chunks_and_one_that_is_not_runs_what_it_has() -> None:
    plan = ChunkPlan.from_args(SimpleNamespace(block_size=24, repeats=2), {})
    code = 0.02  # seconds of audio a code (2 mel frames of 240 samples at 24 kHz)
    assert plan.grow
    # The chunk after the first is the smallest; then 48 codes (0.96 s), then 96 (1.92 s) from then on,
    # each only while the audio already sent leads real time by that chunk's duration.
    assert [plan.least(n, 10.0, code) for n in range(1, 6)] == [24, 48, 96, 96, 96]
    assert plan.least(2, 0.95, code) == 24
    assert plan.least(2, 0.96, code) == 48
    assert plan.least(3, 1.9, code) == 24  # not far enough ahead for 96 codes: no waiting
    assert plan.least(3, -0.5, code) == 24  # behind real time
    fixed = ChunkPlan.from_args(SimpleNamespace(block_size=24, repeats=2), {"grow_chunks": "false"})
    assert [fixed.least(n, 10.0, code) for n in range(1, 6)] == [24] * 5


def test_first_windows_wait_a_moment_for_a_stream_a_code_short_and_no_longer(monkeypatch: pytest.MonkeyPatch) -> None:
    from omnimodel_runtime.engines.omni import code2wav

    plan = ChunkPlan.from_args(SimpleNamespace(block_size=24, repeats=2), {})  # first window: 24 + 12 codes
    engine = code2wav.OmniCode2WavEngine.__new__(code2wav.OmniCode2WavEngine)
    engine._plan, engine._gather_from = plan, None
    engine._wake = threading.Event()
    engine._wake.set()  # a frame has arrived: a hold looks again at once
    engine.clock = WorkClock()  # a hold is idle time, off the stage's busy clock

    def stream(codes: int, start: int = 0) -> SimpleNamespace:
        state = code2wav._Chunked.__new__(code2wav._Chunked)
        state.codes, state.chunk_start, state.ended = [0] * codes, start, False
        return SimpleNamespace(state=state)

    ready, behind, far = stream(36), stream(35), stream(20)
    first = [(ready.state, SimpleNamespace(start=0))]
    now = [100.0]
    monkeypatch.setattr(code2wav.time, "monotonic", lambda: now[0])
    assert not engine._gathering(first, [ready, far])  # nobody is close: go
    assert engine._gathering(first, [ready, behind])  # one code short: hold
    now[0] += code2wav.GATHER_S / 2
    assert engine._gathering(first, [ready, behind])
    now[0] += code2wav.GATHER_S
    assert not engine._gathering(first, [ready, behind])  # waited long enough: go without it
    steady = [(stream(80, start=24).state, SimpleNamespace(start=24))]
    assert not engine._gathering(steady, [ready, behind])  # only first windows wait


def test_a_stream_s_next_window_waits_for_the_larger_chunk_only_while_its_audio_leads_real_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from omnimodel_runtime.engines.omni import code2wav

    dit = SimpleNamespace(block_size=24, repeats=2)
    monkeypatch.setattr(code2wav.time, "monotonic", lambda: 100.0)

    def stream(plan: ChunkPlan, *, waiting: int, audio_s: float, since_first_audio_s: float) -> Any:
        state = code2wav._Chunked.__new__(code2wav._Chunked)
        state.plan, state.repeats, state.ended = plan, 2, False
        state.engine = SimpleNamespace(_hop=240, device="cpu")  # 10 ms a mel frame at 24 kHz
        state.noise = code2wav.PagedNoise(0, 24, 4, "cpu")
        state.codes, state.chunk_start, state.chunks = [0] * (48 + waiting), 48, 2  # two chunks run
        state.voiced, state.first_audio = round(audio_s * 100), 100.0 - since_first_audio_s
        return state

    def chunk(state: Any) -> int | None:
        window = state.window()
        return None if window is None else window.end - window.start

    grow = ChunkPlan.from_args(dit, {})
    # 40 codes waiting: a 24-code chunk and its look-ahead are here, a 48-code one's are not.
    assert chunk(stream(grow, waiting=40, audio_s=2.0, since_first_audio_s=0.5)) is None  # 1.5 s ahead: wait
    assert chunk(stream(grow, waiting=60, audio_s=2.0, since_first_audio_s=0.5)) == 48  # ... until it is here
    assert chunk(stream(grow, waiting=40, audio_s=2.0, since_first_audio_s=1.5)) == 24  # 0.5 s ahead: go
    fixed = ChunkPlan.from_args(dit, {"grow_chunks": False})
    assert chunk(stream(fixed, waiting=40, audio_s=2.0, since_first_audio_s=0.5)) == 24
