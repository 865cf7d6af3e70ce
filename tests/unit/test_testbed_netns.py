"""Waiting on the command that runs in the test bed's network namespace: signals reach it, and it is
never killed before it has cleaned up."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import omnimodel_testbed
from omnimodel_testbed.procs import poll

# This checkout's test bed, whatever the working directory of the wrapper.
E2E = str(Path(omnimodel_testbed.__file__).resolve().parents[1])

WRAPPER = """
import os, signal, sys
from omnimodel_testbed.netns import run_passing_signals
child = ["sh", "-c", 'trap "echo INT >> got; sleep 1; echo cleaned >> got; exit 7" INT; echo > ready; '
         'while :; do sleep 0.05; done']
sys.exit(run_passing_signals(child, os.environ, {signal.SIGINT: None, signal.SIGTERM: signal.SIGINT}))
"""


@pytest.mark.parametrize("started_as", ["foreground", "background-job"])
def test_sigterm_becomes_the_childs_ctrl_c_and_the_child_finishes_its_cleanup(tmp_path: Path, started_as: str) -> None:
    """Also when the wrapper starts with SIGINT ignored, as a non-interactive shell starts its ``&`` jobs
    (CI runners do): the child must still get the SIGINT it is sent."""
    env = {**os.environ, "PYTHONPATH": E2E}
    argv = [sys.executable, "-c", WRAPPER]
    if started_as == "background-job":
        argv = ["sh", "-c", 'trap "" INT; exec "$@"', "sh", *argv]  # SIGINT ignored, inherited through exec
    # Its own session: whatever happens, the wrapper and its child are stopped together (by process group).
    parent = subprocess.Popen(argv, cwd=tmp_path, env=env, start_new_session=True)
    try:
        poll((tmp_path / "ready").exists, timeout=20, what="the child ready", interval=0.05)
        # A SIGINT for the parent alone is not passed on: at a terminal the child gets its own.
        parent.send_signal(signal.SIGINT)
        time.sleep(0.5)
        assert parent.poll() is None
        assert not (tmp_path / "got").exists()
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(timeout=20) == 7  # the child's status, after its whole cleanup
        assert (tmp_path / "got").read_text().split() == ["INT", "cleaned"]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()
