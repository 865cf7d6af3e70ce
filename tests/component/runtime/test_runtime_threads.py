"""Runtime processes size their thread pools from the CPUs they may use, as real processes: ``omnimodel
serve`` pinned to one CPU with ``taskset``, and an ``omnimodel stage`` whose pipeline file puts three stage
processes on this host. Each reports its pools in its start-up line; /proc says how many threads it has.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
from runtime_procs import RuntimeProcess, free_port, openai_client, pipeline_file, running, runtime_env, stage_process

from omnimodel_runtime.serve import serve_pipeline
from omnimodel_runtime.settings import THREAD_ENV, cpu_budget

pytestmark = [pytest.mark.engine]

LINE = re.compile(r"threads: (\d+) \(([^;]*); torch intra (\d+), inter (\d+), OMP (\S+)\)")


def env_without_thread_variables(model_cache: Path) -> dict[str, str]:
    """What a user's shell gives: none of the thread variables (the runtime must not need them)."""
    return {k: v for k, v in runtime_env(model_cache).items() if k not in THREAD_ENV}


def pools(proc: RuntimeProcess) -> tuple[int, str, int, int, str]:
    """The count, the reasons and the torch intra-op, inter-op and OpenMP counts of ``proc``'s line."""
    found = LINE.search(proc.log_path.read_text())
    assert found is not None, f"no threads line in {proc.name}'s log:\n{proc.log_tail()}"
    count, why, intra, inter, omp = found.groups()
    return int(count), why, int(intra), int(inter), omp


def threads_of(proc: RuntimeProcess) -> int:
    assert proc.proc is not None
    found = re.search(r"^Threads:\s+(\d+)", Path(f"/proc/{proc.proc.pid}/status").read_text(), re.MULTILINE)
    assert found is not None
    return int(found.group(1))


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("taskset") is None, reason="needs taskset (util-linux)")
def test_serve_pinned_to_one_cpu_computes_with_one_thread(tmp_path: Path, model_cache: Path, tiny_text: Path) -> None:
    cpu = min(os.sched_getaffinity(0))
    serve = RuntimeProcess(
        "serve",
        ["serve", "--preset", "text", "--model", "tiny://text", "--engine", "transformers"],
        log_dir=tmp_path,
        env=env_without_thread_variables(model_cache),
        port=free_port(),
        wrapper=("taskset", "-c", str(cpu)),
    )
    with running(serve):
        serve.wait_healthy()
        reply = openai_client(serve.url, timeout=60).chat.completions.create(
            model="text",
            messages=[{"role": "user", "content": "Hello there"}],
            max_tokens=16,
        )
        assert reply.choices[0].message.content
        count, why, intra, inter, omp = pools(serve)
        assert (count, intra, inter, omp) == (1, 1, 1, "1")
        assert why.startswith("affinity 1, cgroup quota ")
        # A handful (4 on a 2-core host: the event loop, the engine's worker and helpers), no pools.
        assert threads_of(serve) <= 8


@pytest.mark.slow
def test_stages_sharing_a_host_split_its_cpus(tmp_path: Path, model_cache: Path, tiny_text: Path) -> None:
    """Three replicas of the llm stage on loopback, as split mode by hand places its stages: the one
    started takes a third of the CPUs (at least one), not all of them as torch would by itself."""
    ports = (free_port(), free_port(), free_port())
    pipeline = serve_pipeline("text", "tiny://text", engines=["transformers"], device="cpu")
    path = pipeline_file(pipeline, {"llm": ports}, tmp_path / "pipeline.json")
    stage = stage_process(path, "llm", ports[0], log_dir=tmp_path, env=env_without_thread_variables(model_cache))
    expected = max(1, cpu_budget().usable // 3)
    with running(stage):
        stage.wait_healthy()  # the engine has warmed up: torch's pools exist
        count, why, intra, _, omp = pools(stage)
        assert (count, intra, omp) == (expected, expected, str(expected))
        assert why.endswith("shared by 3 stage processes on this host")
