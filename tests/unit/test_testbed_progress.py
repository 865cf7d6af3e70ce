"""The demo's progress lines: numbered steps, a heartbeat while one runs, a note when it is slow, and
failures that name the step and where to look."""

from __future__ import annotations

import io
import re
import time

import pytest

from omnimodel_testbed.progress import Reporter, StepError

PLAN = [("build", "Build things"), ("wait", "Wait for things")]


def test_a_long_step_is_never_silent_and_says_when_it_is_slow() -> None:
    out = io.StringIO()
    reporter = Reporter(PLAN, out=out, heartbeat=0.3)
    try:
        with reporter.step("wait", slow_after=1.0, look_at=["/logs/a.log"]):
            reporter.status = "2 pods loading"
            time.sleep(1.6)
    finally:
        reporter.close()
    lines = out.getvalue().splitlines()
    assert re.fullmatch(r"\[0:0\d\] ==> \[2/2\] Wait for things", lines[0])
    beats = [ln for ln in lines if "... still at it" in ln]
    assert len(beats) >= 2 and all(ln.endswith(": 2 pods loading") for ln in beats)
    slow = [ln for ln in lines if "!! slower than expected" in ln]
    assert len(slow) == 1  # said once, then heartbeats again
    assert "/logs/a.log" in out.getvalue()


def test_a_failure_names_its_step_and_where_to_look() -> None:
    reporter = Reporter(PLAN, out=io.StringIO())
    failed = r"step \[1/2\] Build things failed"
    with (
        pytest.raises(StepError, match=failed + r": no compiler(.|\n)*look at: /logs/b"),
        reporter.step("build", slow_after=10, look_at=lambda: ["/logs/b"]),
    ):
        raise StepError("no compiler")
    with (
        pytest.raises(StepError, match=failed + r": OSError: disk full") as info,
        reporter.step("build", slow_after=10),
    ):
        raise OSError("disk full")
    assert isinstance(info.value.__cause__, OSError)  # the traceback stays reachable
    reporter.close()
