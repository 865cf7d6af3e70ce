"""`make demo`'s script, end to end, as a user runs it: exit 0, a WAV that decodes, a PNG that opens,
progress that never goes quiet for 30 s, and nothing left behind; Ctrl-C and ``--keep`` tear down as
cleanly.

Each run starts its own control plane in its own network namespace (own state dir), so these tests need
no cluster fixture and leave none behind. On 2 cores with the binaries cached a run takes about a minute.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import wave
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from PIL import Image

from omnimodel_testbed import procs
from omnimodel_testbed.cluster import Cluster
from omnimodel_testbed.demo import STEPS, processes_in_netns

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
#: The issue's promise: progress never silent for longer than this.
MAX_SILENCE = 30.0


@dataclass
class Demo:
    """``python -m omnimodel_testbed demo`` in a session of its own (a terminal's Ctrl-C is a SIGINT to
    its process group), its output lines timestamped as they arrive."""

    state: Path
    out: Path
    extra: list[str] = field(default_factory=list)
    lines: list[tuple[float, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "omnimodel_testbed", "--state-dir", str(self.state), "demo", "--out", str(self.out),
             *self.extra],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env={k: v for k, v in os.environ.items() if k not in ("DEMO_KEEP", "OMNIMODEL_TESTBED_STATE_DIR")},
        )  # fmt: skip
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with self.proc.stdout:
            for line in self.proc.stdout:
                self.lines.append((time.monotonic(), line.rstrip("\n")))

    @property
    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def wait_for_line(self, pattern: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.text, re.M):
            assert self.proc.poll() is None, f"demo exited with {self.proc.returncode}:\n{self.text}"
            assert time.monotonic() < deadline, f"no line matching {pattern!r} in {timeout:.0f}s:\n{self.text}"
            time.sleep(0.2)

    def finish(self, timeout: float) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGINT)  # let it tear down, then fail
            self.proc.wait(timeout=120)
            pytest.fail(f"demo still running after {timeout:.0f}s:\n{self.text}")
        self._reader.join(timeout=10)
        self.ended = time.monotonic()
        return rc

    def longest_silence(self) -> float:
        stamps = [self.started, *(t for t, _ in self.lines), self.ended]
        return max(b - a for a, b in itertools.pairwise(stamps))


def assert_nothing_left(state: Path) -> None:
    """No process the demo started runs, and its network namespace has no process (so it is gone)."""
    inner = json.loads((state / "demo" / "inner.json").read_text())
    assert not procs.is_alive(procs.ProcessRecord("demo", inner["pid"], inner["start_ticks"], "", ""))
    assert processes_in_netns(inner["netns"]) == []
    records = [procs.ProcessRecord.from_json(r) for r in json.loads((state / "demo" / "processes.json").read_text())]
    assert records, "no pod or operator process was recorded"
    assert [r.name for r in records if procs.is_alive(r)] == []
    assert Cluster(state).load_state() is None  # `down` ran: no cluster recorded as running


def test_make_demo_deploys_talks_scales_and_leaves_nothing(tmp_path: Path) -> None:
    demo = Demo(tmp_path / "state", tmp_path / "out")
    rc = demo.finish(timeout=600)
    text = demo.text
    assert rc == 0, text
    for key, title in STEPS:
        assert f"] {title}" in text, f"step {key} never ran:\n{text}"
    assert demo.longest_silence() <= MAX_SILENCE, text

    # The stages landed on their vendors' fake nodes.
    for pod, node in (
        ("omni-tiny-thinker", "h200-"), ("omni-tiny-talker", "mi300x-0"), ("omni-tiny-code2wav", "cpu-"),
        ("image-tiny-denoise", "ascend910b-0"), ("image-tiny-decode", "h200-"), ("image-tiny-encode", "cpu-"),
    ):  # fmt: skip
        assert re.search(rf"^\[\d+:\d\d\]\s+{pod}-\S+\s+Running\s+{node}", text, re.M), f"{pod} not on {node}:\n{text}"

    wav = tmp_path / "out" / "omni-answer.wav"
    assert str(wav) in text  # the path is printed
    with wave.open(str(wav)) as audio:
        assert (audio.getframerate(), audio.getnchannels(), audio.getsampwidth()) == (24000, 1, 2)
        assert audio.getnframes() > 0
    png = tmp_path / "out" / "image.png"
    assert str(png) in text
    with Image.open(png) as image:
        assert (image.format, image.size) == ("PNG", (64, 64))
        image.load()

    # The scaled-out thinker pod served some of the chats sent after it became healthy.
    (served,) = re.findall(r"omni-tiny-thinker-\S+\s+on h200-\d\s+\S+\s+(\d+) \(new\)", text)
    assert int(served) > 0
    assert "Nothing left behind" in text
    assert_nothing_left(tmp_path / "state")


def test_ctrl_c_while_the_models_load_tears_everything_down(tmp_path: Path) -> None:
    demo = Demo(tmp_path / "state", tmp_path / "out")
    demo.wait_for_line(r"pod omni-tiny-thinker-\S+ is running here as pid", timeout=300)
    os.killpg(demo.proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends
    rc = demo.finish(timeout=120)
    assert rc == 130, demo.text
    assert "Interrupted (Ctrl-C): tearing down." in demo.text
    assert "stopped the control plane" in demo.text
    assert "Nothing left behind" in demo.text
    assert demo.longest_silence() <= MAX_SILENCE, demo.text
    assert_nothing_left(tmp_path / "state")


def test_keep_leaves_it_reachable_until_sigterm(tmp_path: Path) -> None:
    state = tmp_path / "state"
    demo = Demo(state, tmp_path / "out", extra=["--keep"])
    try:
        demo.wait_for_line(r"^\[\d+:\d\d\] Left running", timeout=600)
        # What the demo prints for reaching it works: kubectl and the gateway from inside its namespace.
        enter = [sys.executable, "-m", "omnimodel_testbed", "--state-dir", str(state), "enter", "--"]
        omni = subprocess.run([*enter, "kubectl", "get", "omni", "-n", "demo", "-o", "json"], capture_output=True,
                              text=True, check=True, cwd=REPO, timeout=60)  # fmt: skip
        ready = {
            o["metadata"]["name"]: next(c["status"] for c in o["status"]["conditions"] if c["type"] == "Ready")
            for o in json.loads(omni.stdout)["items"]
        }
        assert ready == {"omni-tiny": "True", "image-tiny": "True"}
        models = subprocess.run(
            [*enter, sys.executable, "-c",
             "import httpx; print(httpx.get('http://omni-tiny-gateway.demo.svc:8000/v1/models').json()['data'][0]['id'])"],
            capture_output=True, text=True, check=True, cwd=REPO, timeout=60,
        )  # fmt: skip
        assert models.stdout.strip() == "qwen2.5-omni"
        assert demo.proc.poll() is None
        demo.proc.send_signal(signal.SIGTERM)  # to the outside process only: it forwards
        rc = demo.finish(timeout=120)
        assert rc == 130, demo.text
        assert "Nothing left behind" in demo.text
    finally:
        # A failed check above must not leave the kept demo (its cluster and pods) running.
        if demo.proc.poll() is None:
            demo.proc.send_signal(signal.SIGTERM)
            demo.finish(timeout=120)
    assert_nothing_left(state)
