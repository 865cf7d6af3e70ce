"""``omnimodel bench --mode omni`` on the tiny Qwen2.5-Omni on CPU: the same command the GPU runs
(bench/h200.sh), at a small concurrency ladder, stages batched as on a GPU, the Hugging Face whole model in
a process of its own afterwards. About 40 s on two cores."""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from runtime_procs import runtime_env

from omnimodel_runtime.bench.omni import OmniSample, ladder

pytestmark = [pytest.mark.engine, pytest.mark.slow]


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
