"""``omnimodel bench --mode omni`` on the tiny Qwen2.5-Omni on CPU: the same command the GPU runs
(bench/h200.sh), at a small concurrency ladder, stages batched as on a GPU, each stage's load over a level
read from its process's metrics, the Hugging Face whole model in a process of its own afterwards. About 40 s
on two cores."""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from runtime_procs import runtime_env

from omnimodel_runtime.bench.omni import OmniSample, ladder, stage_load
from omnimodel_runtime.engines.omni.engine import WorkClock

pytestmark = [pytest.mark.engine]


@pytest.mark.slow
def test_the_omni_ladder_reports_each_level_and_the_whole_model_from_its_own_process(
    tmp_path: Path, model_cache: Path, tiny_omni: Path
) -> None:
    out = tmp_path / "omni.json"
    command = [
        *(sys.executable, "-m", "omnimodel_runtime", "bench", "--mode", "omni"),
        *("--preset", "qwen2.5-omni", "--model", "tiny://qwen2.5-omni", "--max-tokens", "8", "--rounds", "1"),
        *("--omni-prompts", "1", "--omni-concurrency", "1,2", "--omni-requests", "2"),
        *("--omni-deployments", "three_processes", "--hf-baseline", "1", "--engine-arg", "batching=true"),
        *("--start-timeout", "240", "--out", str(out)),
    ]
    env = runtime_env(model_cache, OMNIMODEL_DEVICE="cpu", OMP_NUM_THREADS=1)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["meta"]["omni_concurrency"] == [1, 2]
    results = report["results"]
    assert "errors" not in results, results.get("errors")
    levels = results["concurrency"]["three_processes"]
    assert sorted(levels) == ["1", "2"]
    for level, section in levels.items():
        assert section["failures"] == 0, section
        assert section["requests"] == 2
        assert section["concurrency"] == int(level)
        assert section["requests_per_s"] > 0
        assert 0 < section["ttfa_p50_s"] <= section["ttfa_max_s"]
        assert section["rtf_p50"] > 0
        # Each stage process's load over the level, read from its /metrics.
        stages = section["stages"]
        assert set(stages) == {"thinker", "talker", "code2wav"}, stages
        for stage, load in stages.items():
            assert 0 < load["busy_fraction"] <= 1, (level, stage, load)
            assert load["requests"] == 2, (level, stage, load)
            assert load["steps"] > 0 and load["busy_ms_per_step"] > 0, (level, stage, load)
            assert load["queue_wait_mean_s"] >= 0
        assert section["busiest_stage"] in stages
        assert stages["talker"]["generated_per_s"] > 0
    # One stream at a time, every step is one request's; two at once share the talker's steps.
    assert levels["1"]["stages"]["talker"]["mean_batch"] == 1
    assert levels["2"]["stages"]["talker"]["mean_batch"] > 1
    whole = results["hf_whole_model"]
    assert whole["requests"] == 1 and whole["audio_s_mean"] > 0
    assert set(results["vs_hf_whole_model"]["three_processes"]) == {"sequential", "1", "2"}


class _Flaky:
    """A deployment's client whose every third request fails as a dropped stream would."""

    def __init__(self) -> None:
        self.sent = 0

    async def streamed(self, prompt: str) -> OmniSample:
        self.sent += 1
        if self.sent % 3 == 0:
            raise RuntimeError("stream ended early")
        return OmniSample(latency=1.0, ttft=0.1, ttfa=0.2, text_done=0.5, audio_s=2.0, text_tokens=8)


def test_a_level_counts_its_failed_requests_and_goes_on() -> None:
    args = argparse.Namespace(omni_concurrency=[1, 3], omni_requests=3)
    client: Any = _Flaky()
    levels = asyncio.run(ladder(args, {"d": client}))["d"]
    assert [levels[level]["failures"] for level in ("1", "3")] == [1, 1]
    assert [levels[level]["requests"] for level in ("1", "3")] == [2, 2]
    assert levels["3"]["failure_examples"] == ["RuntimeError: stream ended early"]
    assert levels["1"]["rtf_p50"] == 0.5
    assert levels["1"]["started_unix"] <= levels["3"]["started_unix"] <= time.time()


def test_a_stage_s_load_is_the_counters_growth_over_the_level() -> None:
    before = {"code2wav": {"busy_s": 10.0, "steps": 5, "batch_rows": 5, "admitted": 2, "queue_wait_s": 0.1}}
    after = {
        "code2wav": {"busy_s": 13.0, "steps": 9, "batch_rows": 17, "admitted": 6, "queue_wait_s": 0.5},
        "thinker": {"busy_s": 1.0, "steps": 0, "batch_rows": 0, "admitted": 0, "queue_wait_s": 0.0},
    }
    load = stage_load(before, after, wall=4.0)
    assert load["code2wav"] == {
        "busy_fraction": 0.75,
        "steps": 4,
        "mean_batch": 3.0,
        "busy_ms_per_step": 750.0,
        "requests": 4,
        "queue_wait_mean_s": 0.1,
    }
    assert load["thinker"] == {"busy_fraction": 0.25, "steps": 0, "requests": 0}


def test_the_work_clock_leaves_out_the_waits_inside_a_step_and_reads_the_step_in_progress() -> None:
    clock = WorkClock()
    with clock.working():
        work_until = time.monotonic() + 0.05
        while time.monotonic() < work_until:  # busy on purpose: this is the work being timed
            pass
        with clock.idle():
            time.sleep(0.2)  # stands for an upstream frame that takes its time
        in_progress = clock.read().busy_seconds
    done = clock.read().busy_seconds
    assert 0.05 <= in_progress <= done < 0.2  # 0.25 and more with the wait counted
