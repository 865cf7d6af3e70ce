"""Process bookkeeping: stop by PID, never signal a recycled PID, fail fast on crashes."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from omnimodel_testbed import procs

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


def test_start_then_stop_by_pid(tmp_path: Path) -> None:
    rec = procs.start("sleeper", SLEEPER, tmp_path / "s.log")
    assert procs.is_alive(rec)
    # A record loaded back from JSON (as `down` in another process does) is enough to stop it.
    again = procs.ProcessRecord.from_json(rec.to_json())
    assert procs.stop([again], grace=5) == [again]
    assert not procs.is_alive(rec)


def test_recycled_pid_is_never_signalled(tmp_path: Path) -> None:
    rec = procs.start("sleeper", SLEEPER, tmp_path / "s.log")
    try:
        impostor = dataclasses.replace(rec, start_ticks=rec.start_ticks + 1)
        assert not procs.is_alive(impostor)
        assert procs.stop([impostor]) == []
        assert procs.is_alive(rec)
    finally:
        procs.stop([rec], grace=5)


def test_wait_until_fails_fast_with_log_when_process_dies(tmp_path: Path) -> None:
    rec = procs.start("crasher", [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"], tmp_path / "c.log")
    with pytest.raises(procs.ReadinessTimeoutError, match="exited while waiting") as info:
        procs.wait_until("never", lambda: False, timeout=60, watch=[rec])
    assert "boom" in str(info.value)
    procs.stop([rec])


def test_wait_until_times_out_with_last_error() -> None:
    def probe() -> bool:
        raise ConnectionRefusedError("nope")

    with pytest.raises(procs.ReadinessTimeoutError, match="ConnectionRefusedError"):
        procs.wait_until("probe", probe, timeout=0.3, interval=0.05)


def test_free_ports_are_distinct() -> None:
    ports = procs.free_ports(6)
    assert len(set(ports)) == 6


def test_a_process_started_elsewhere_is_recorded_and_stopped_by_pid(tmp_path: Path) -> None:
    proc = subprocess.Popen(SLEEPER, start_new_session=True)
    try:
        rec = procs.record("pod p", proc.pid, tmp_path / "p.log")
        assert procs.is_alive(procs.ProcessRecord.from_json(rec.to_json()))
        assert procs.stop([rec], grace=5) == [rec]
        assert proc.wait(timeout=5) == -15
        with pytest.raises(RuntimeError, match="not running"):
            procs.record("pod p", proc.pid, tmp_path / "p.log")
    finally:
        if proc.poll() is None:
            proc.kill()


def test_poll_returns_the_first_truthy_value_and_names_what_it_waited_for() -> None:
    values = iter([None, 0, "ready"])
    assert procs.poll(lambda: next(values), timeout=10, what="ready", interval=0.01) == "ready"
    with pytest.raises(TimeoutError, match=r"waiting for the moon; last value: \[\]"):
        procs.poll(list, timeout=0.1, what="the moon", interval=0.01, error=TimeoutError)


def test_terminate_kills_a_child_that_ignores_sigterm() -> None:
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(120)"
    with subprocess.Popen([sys.executable, "-c", stubborn], stdout=subprocess.PIPE) as proc:
        try:
            assert proc.stdout is not None
            proc.stdout.readline()  # its handler is installed
            assert procs.terminate(proc, grace=0.2) == -9
            assert procs.terminate(proc, grace=0.2) == -9  # already gone: its exit code again
        finally:
            if proc.poll() is None:
                proc.kill()


def test_setup_env_returns_the_directory_printed_last(tmp_path: Path) -> None:
    env = tmp_path / "env"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "tool").touch()
    script = tmp_path / "setup-env"
    script.write_text(f"echo building\necho {env}\n")
    assert procs.setup_env(script, "bin/tool", RuntimeError) == env
    with pytest.raises(LookupError, match="has no bin/other"):
        procs.setup_env(script, "bin/other", LookupError)
    script.write_text("exit 3\n")
    with pytest.raises(LookupError, match="failed with exit code 3"):
        procs.setup_env(script, "bin/tool", LookupError)
