"""The pure parts of e2e/bench_autoscaling.py: trace parsing, replica-second integration, percentiles."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench_autoscaling import (
    DEFAULT_TRACE,
    Phase,
    Record,
    TraceError,
    dumps,
    load_trace,
    parse_trace,
    per_phase,
    percentile,
    request_summary,
    step_integral,
)


def test_the_shipped_trace_parses() -> None:
    trace = load_trace(DEFAULT_TRACE)
    assert [p.name for p in trace.phases] == ["idle", "burst", "plateau", "idle-tail"]
    assert 120 <= trace.duration <= 300  # a few minutes a run
    assert trace.max_concurrency == 6
    assert trace.concurrency_at(0) == 0
    assert trace.concurrency_at(30) == 6
    assert trace.concurrency_at(trace.duration) == 0


def test_phases_as_a_bare_list_and_rates_per_second() -> None:
    bare = parse_trace([{"seconds": 2, "concurrency": 1}, {"name": "r", "seconds": 1.5, "rate": 2}])
    assert bare.phases == (Phase("phase0", 2.0, concurrency=1), Phase("r", 1.5, rate=2.0))
    # Evenly spaced arrivals within the phase, none in closed-loop phases.
    assert bare.arrivals() == [2.0, 2.5, 3.0]
    rates = parse_trace({"rates": [0, 0, 3, 3, 1]})
    assert [(p.seconds, p.rate) for p in rates.phases] == [(2.0, 0.0), (2.0, 3.0), (1.0, 1.0)]
    assert len(rates.arrivals()) == 7
    assert rates.duration == 5


@pytest.mark.parametrize(
    "bad",
    [
        [],
        {"phases": [{"seconds": 0, "concurrency": 1}]},
        [{"seconds": 5}],
        [{"seconds": 5, "concurrency": 1, "rate": 1}],
        [{"seconds": 5, "concurrency": 1.5}],
        [{"seconds": 5, "concurrency": -1}],
        [{"seconds": 5, "rate": -1}],
        [{"seconds": 5, "concurrency": 1, "spike": True}],
        {"rates": []},
        {"rates": [1, "x"]},
    ],
)
def test_a_malformed_trace_is_refused(bad: object) -> None:
    with pytest.raises(TraceError):
        parse_trace(bad)


def test_replica_seconds_hold_each_sample_until_the_next() -> None:
    # 1 replica for 10 s, 3 for 10 s, 1 for the last 10 s; the first sample (at 0.5 s) counts from 0.
    assert step_integral([(0.5, 1), (10, 3), (20, 1)], 30) == pytest.approx(50)
    # Samples past the end are cut off; nothing sampled is nothing spent.
    assert step_integral([(0, 2), (5, 4), (40, 9)], 10) == pytest.approx(30)
    assert step_integral([], 10) == 0


def test_percentiles_interpolate_between_ranks() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([4, 1, 3, 2], 50) == pytest.approx(2.5)
    assert percentile(list(range(101)), 99) == pytest.approx(99)
    assert percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)


def test_request_summary_counts_and_phases() -> None:
    trace = parse_trace([{"name": "a", "seconds": 10, "concurrency": 1}, {"name": "b", "seconds": 10, "rate": 1}])
    records = [Record(1, 0.5), Record(2, 1.5), Record(12, 2.0, error="APITimeoutError: x"), Record(15, 1.0)]
    s = request_summary(records)
    assert (s["sent"], s["served"], s["failed"]) == (4, 3, 1)
    assert s["latency_s"]["p50"] == 1.0
    assert s["errors"] == {"APITimeoutError: x": 1}
    a, b = per_phase(records, trace)
    assert (a["sent"], a["served"], b["sent"], b["failed"]) == (2, 2, 2, 1)


def test_json_keeps_number_lists_on_one_line(tmp_path: Path) -> None:
    text = dumps({"samples": [[0.0, 1, 1, 1], [1.0, 3, 2, 1]], "label": "auto"})
    assert "[0.0, 1, 1, 1]" in text
    assert json.loads(text) == {"samples": [[0.0, 1, 1, 1], [1.0, 3, 2, 1]], "label": "auto"}
