"""How many threads a runtime process computes with: the CPUs it may use (affinity, cgroup v2 and v1 CPU
quotas, read from fake cgroup trees here), the split among stage processes on one host, the variables set
for OpenMP and friends, and that the command line sets them before torch or numpy load."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from omnimodel_runtime.cli import _stage_processes_here
from omnimodel_runtime.serve import serve_pipeline
from omnimodel_runtime.settings import (
    CpuBudget,
    RuntimeSettings,
    cgroup_cpu_quota,
    cpu_budget,
    plan_threads,
    thread_env,
)


def cgroup_tree(tmp_path: Path, self_cgroup: str, files: dict[str, str]) -> tuple[Path, Path]:
    """A fake ``/sys/fs/cgroup`` holding ``files`` (path under it: content) and a fake
    ``/proc/self/cgroup`` saying ``self_cgroup``."""
    root = tmp_path / "sys-fs-cgroup"
    root.mkdir()
    for name, content in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(content + "\n")
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text(self_cgroup)
    return root, proc


# ------------------------------------------------------------------------------ cgroup v2


@pytest.mark.parametrize(
    ("cpu_max", "quota"),
    [
        ("200000 100000", 2.0),
        ("150000 100000", 1.5),  # a fractional limit: 1500m
        ("50000 100000", 0.5),
        ("max 100000", None),  # no limit
        ("max", None),
    ],
)
def test_v2_quota_of_a_namespaced_container(tmp_path: Path, cpu_max: str, quota: float | None) -> None:
    root, proc = cgroup_tree(tmp_path, "0::/\n", {"cpu.max": cpu_max})
    assert cgroup_cpu_quota(root, proc) == quota


def test_v2_quota_is_the_tightest_of_the_cgroup_and_its_ancestors(tmp_path: Path) -> None:
    # A pod's limit sits on the pod's cgroup; its container's own says "max".
    files = {
        "kubepods.slice/cpu.max": "max 100000",
        "kubepods.slice/pod1/cpu.max": "300000 100000",
        "kubepods.slice/pod1/ctr/cpu.max": "max 100000",
    }
    root, proc = cgroup_tree(tmp_path, "0::/kubepods.slice/pod1/ctr\n", files)
    assert cgroup_cpu_quota(root, proc) == 3.0


def test_v2_without_a_cgroup_namespace_reads_the_container_root(tmp_path: Path) -> None:
    # /proc/self/cgroup names the host's path; the container's /sys/fs/cgroup is its own cgroup.
    root, proc = cgroup_tree(tmp_path, "0::/kubepods/burstable/pod1/ctr\n", {"cpu.max": "250000 100000"})
    assert cgroup_cpu_quota(root, proc) == 2.5


def test_no_cgroup_files_is_no_limit(tmp_path: Path) -> None:
    root, proc = cgroup_tree(tmp_path, "0::/user.slice\n", {})
    assert cgroup_cpu_quota(root, proc) is None
    assert cgroup_cpu_quota(root, tmp_path / "no-such-file") is None


# ------------------------------------------------------------------------------ cgroup v1


V1_SELF = "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n"


@pytest.mark.parametrize(
    ("quota_us", "period_us", "quota"),
    [("200000", "100000", 2.0), ("50000", "100000", 0.5), ("75000", "50000", 1.5), ("-1", "100000", None)],
)
def test_v1_cfs_quota(tmp_path: Path, quota_us: str, period_us: str, quota: float | None) -> None:
    files = {"cpu,cpuacct/docker/abc/cpu.cfs_quota_us": quota_us, "cpu,cpuacct/docker/abc/cpu.cfs_period_us": period_us}
    root, proc = cgroup_tree(tmp_path, V1_SELF, files)
    assert cgroup_cpu_quota(root, proc) == quota


def test_v1_under_the_cpu_link_and_at_a_container_root(tmp_path: Path) -> None:
    # Docker mounts the container's own cgroup at /sys/fs/cgroup/cpu (a link to cpu,cpuacct elsewhere).
    files = {"cpu/cpu.cfs_quota_us": "300000", "cpu/cpu.cfs_period_us": "100000"}
    root, proc = cgroup_tree(tmp_path, V1_SELF, files)
    assert cgroup_cpu_quota(root, proc) == 3.0


def test_v1_answers_on_a_hybrid_host_whose_v2_tree_has_no_cpu_controller(tmp_path: Path) -> None:
    files = {
        "unified/cgroup.procs": "",
        "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "100000",
        "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000",
    }
    root, proc = cgroup_tree(tmp_path, V1_SELF, files)
    assert cgroup_cpu_quota(root, proc) == 1.0


def test_v2_wins_where_it_holds_the_cpu_controller(tmp_path: Path) -> None:
    files = {
        "cpu.max": "100000 100000",
        "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "800000",
        "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000",
    }
    root, proc = cgroup_tree(tmp_path, V1_SELF, files)
    assert cgroup_cpu_quota(root, proc) == 1.0


# ------------------------------------------------------------------------------ usable CPUs and the plan


@pytest.mark.parametrize(
    ("affinity", "quota", "usable"),
    [
        (64, 2.0, 2),  # a 2-CPU pod on a 64-core node
        (64, 1.5, 2),  # fractional quotas round up: 1500m may run 2 threads at 75 %
        (64, 0.25, 1),
        (1, 8.0, 1),  # taskset -c 0 under a generous quota
        (16, None, 16),
        (0, None, 1),
    ],
)
def test_usable_cpus_are_affinity_capped_by_the_quota(affinity: int, quota: float | None, usable: int) -> None:
    assert CpuBudget(affinity=affinity, quota=quota).usable == usable


def test_cpu_budget_of_this_process_counts_its_affinity() -> None:
    assert cpu_budget().affinity == len(os.sched_getaffinity(0))


def test_plan_from_cpus_split_among_stage_processes_on_this_host() -> None:
    budget = CpuBudget(affinity=16, quota=None)
    assert plan_threads(budget, setting=None, environ={}).count == 16
    plan = plan_threads(budget, setting=None, environ={}, sharers=3)
    assert (plan.count, plan.source, plan.sharers) == (5, "cpus", 3)
    assert plan.describe() == "affinity 16, cgroup quota none, shared by 3 stage processes on this host"
    assert plan_threads(CpuBudget(affinity=2, quota=None), setting=None, environ={}, sharers=3).count == 1
    capped = plan_threads(CpuBudget(affinity=64, quota=1.5), setting=None, environ={}, sharers=0)
    assert (capped.count, capped.describe()) == (2, "affinity 64, cgroup quota 1.5")


def test_the_setting_wins_then_the_users_omp_num_threads() -> None:
    budget = CpuBudget(affinity=64, quota=2.0)
    plan = plan_threads(budget, setting=6, environ={"OMP_NUM_THREADS": "3"}, sharers=3)
    assert (plan.count, plan.describe()) == (6, "from OMNIMODEL_CPU_THREADS, affinity 64, cgroup quota 2")
    assert plan_threads(budget, setting=None, environ={"OMP_NUM_THREADS": "3"}).count == 3
    assert plan_threads(budget, setting=None, environ={"OMP_NUM_THREADS": "4,2"}).count == 4
    for unusable in ("", "0", "lots"):
        assert plan_threads(budget, setting=None, environ={"OMP_NUM_THREADS": unusable}).source == "cpus"


def test_cpu_threads_setting_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert RuntimeSettings().cpu_threads is None
    monkeypatch.setenv("OMNIMODEL_CPU_THREADS", "3")
    assert RuntimeSettings().cpu_threads == 3
    monkeypatch.setenv("OMNIMODEL_CPU_THREADS", "0")
    with pytest.raises(ValueError, match="cpu_threads"):
        RuntimeSettings()


def test_thread_env_leaves_what_the_user_set() -> None:
    assert thread_env(4, {}) == {
        "OMP_NUM_THREADS": "4",
        "MKL_NUM_THREADS": "4",
        "OPENBLAS_NUM_THREADS": "4",
        "RAYON_NUM_THREADS": "4",
    }
    one = thread_env(1, {"MKL_NUM_THREADS": "8", "TOKENIZERS_PARALLELISM": "true"})
    assert one == {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "RAYON_NUM_THREADS": "1"}
    assert thread_env(1, {})["TOKENIZERS_PARALLELISM"] == "false"


def test_stage_processes_here_are_the_loopback_endpoints() -> None:
    urls = {
        "thinker": ["http://127.0.0.1:8001", "http://localhost:8011"],
        "talker": ["http://[::1]:8002"],
        "code2wav": ["http://code2wav.ml.svc:8000"],
    }
    assert _stage_processes_here(serve_pipeline("qwen2.5-omni", "tiny://qwen2.5-omni", endpoints=urls)) == 3
    cluster = {"thinker": ["http://thinker:8000"], "talker": ["http://10.0.0.7:8000"]}
    assert _stage_processes_here(serve_pipeline("qwen2.5-omni", "tiny://qwen2.5-omni", endpoints=cluster)) == 0
    assert _stage_processes_here(serve_pipeline("text", "tiny://text")) == 0


# What the CLI has loaded when it sets the thread variables: OpenMP (torch) and OpenBLAS (numpy) read
# them once, when loaded, so neither may be loaded yet.
SPY = """
import json, sys
from omnimodel_runtime import cli

def spy(*args, **kwargs):
    print(json.dumps(sorted(m for m in ("numpy", "torch") if m in sys.modules)))
    raise SystemExit(0)

cli._limit_threads = spy
cli.main(sys.argv[1:])
"""


@pytest.mark.parametrize("command", ["stage", "gateway", "serve"])
def test_thread_variables_are_set_before_torch_or_numpy_load(tmp_path: Path, command: str) -> None:
    path = tmp_path / "pipeline.json"
    path.write_text(serve_pipeline("text", "tiny://text", endpoints={"llm": ["http://127.0.0.1:8001"]}).to_json())
    argv = {
        "stage": ["stage", "--pipeline", str(path), "--stage", "llm"],
        "gateway": ["gateway", "--pipeline", str(path)],
        "serve": ["serve", "--preset", "text", "--model", "tiny://text"],
    }[command]
    out = subprocess.run([sys.executable, "-c", SPY, *argv], capture_output=True, text=True, check=True, timeout=60)
    assert json.loads(out.stdout) == []
