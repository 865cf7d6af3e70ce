"""The test bed's pod runner: private /dev/shm per pod, kubelet-style env, vLLM-Omni pods, group stop."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from omnimodel_testbed.kubelet import PodRunner, expand_env_refs, is_vllm_omni, shm_size
from omnimodel_testbed.vllm_omni import VLLM_OMNI_CPU_ENV


class NoAPI:
    def get(self, path: str) -> dict[str, Any]:
        raise AssertionError(f"unexpected API call {path}")


def pod(name: str, command: list[str], *, env: list[dict[str, Any]] | None = None, **spec: Any) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "main", "command": command, "env": env or []}
    container.update(spec.pop("container", {}))
    return {
        "metadata": {"name": name, "uid": f"uid-{name}", "namespace": "ns"},
        "spec": {"containers": [container], "nodeName": "node-a", **spec},
        "status": {"phase": "Running", "podIP": "127.0.0.9", "hostIP": "127.0.0.1"},
    }


def runner(tmp_path: Path, vllm_env: Path | None = None) -> PodRunner:
    return PodRunner(
        NoAPI(),  # type: ignore[arg-type]
        "ns",
        tmp_path / "pods",
        tmp_path / "bin",
        vllm_omni_env=lambda: vllm_env or pytest.fail("vLLM-Omni env asked for by a plain pod"),
    )


def wait_for(path: Path, timeout: float = 20) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().endswith("END\n"):
            return path.read_text()
        time.sleep(0.05)
    raise AssertionError(f"{path} not written in {timeout}s")


def test_env_refs_expand_like_the_kubelet() -> None:
    env = {"POD_IP": "10.244.0.7", "PORT": "8000"}
    assert expand_env_refs("--omni-master-address=$(POD_IP):$(PORT)", env) == "--omni-master-address=10.244.0.7:8000"
    assert expand_env_refs("$(UNSET) $$(POD_IP) $PORT", env) == "$(UNSET) $(POD_IP) $PORT"


def test_vllm_containers_are_recognised_by_their_command() -> None:
    assert is_vllm_omni({"command": ["vllm", "serve", "m", "--omni"]})
    assert is_vllm_omni({"command": ["/usr/local/bin/vllm"], "args": ["serve"]})
    assert not is_vllm_omni({"command": ["omnimodel", "stage"]})
    assert not is_vllm_omni({"args": ["serve"]})


def test_shm_size_follows_a_memory_emptydir_at_dev_shm() -> None:
    plain = pod("p", ["true"])
    assert shm_size(plain) == "64m"
    mounted = pod(
        "p",
        ["true"],
        volumes=[{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}}],
        container={"volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}]},
    )
    assert shm_size(mounted) == "2g"


def test_each_pod_gets_a_private_dev_shm_and_downward_env(tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    marker = f"omnimodel-test-{os.getpid()}"
    script = (
        f"echo x > /dev/shm/{marker}; df -k /dev/shm | tail -n1 > {out}; ls /dev/shm >> {out}; "
        f'echo "$POD_IP $POD_NAME $ADDR" >> {out}; echo END >> {out}'
    )
    env = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "ADDR", "value": "tcp://$(POD_IP):5000"},
    ]
    r = runner(tmp_path)
    proc = r._launch(pod("head", ["sh", "-c", script], env=env))
    try:
        text = wait_for(out)
    finally:
        r._terminate(proc)
    size_kib, files, env_line = text.splitlines()[0].split()[1], text.splitlines()[1:-2], text.splitlines()[-2]
    assert int(size_kib) == 64 * 1024
    assert files == [marker]  # empty before this pod wrote to it
    assert not Path("/dev/shm", marker).exists()  # and the host's /dev/shm never saw the file
    assert env_line == "127.0.0.9 head tcp://127.0.0.9:5000"


def test_a_relative_pythonpath_still_names_this_checkout_from_the_pod_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`PYTHONPATH=operator:runtime:e2e` selects a worktree's code; a pod runs in its own directory."""
    out = tmp_path / "out.txt"
    monkeypatch.setenv("PYTHONPATH", "runtime:e2e")
    r = runner(tmp_path)
    proc = r._launch(pod("p", ["sh", "-c", f'echo "$PYTHONPATH" > {out}; echo END >> {out}']))
    try:
        line = wait_for(out).splitlines()[0]
    finally:
        r._terminate(proc)
    assert line == f"{Path.cwd() / 'runtime'}:{Path.cwd() / 'e2e'}"


def test_sync_reports_each_started_process_once(tmp_path: Path) -> None:
    """What `make demo` records to stop pods by PID even if the process that ran them died."""

    class OnePod:
        def get(self, path: str) -> dict[str, Any]:
            assert path == "/api/v1/namespaces/ns/pods"
            return {"items": [pod("p", ["sleep", "60"])]}

    seen: list[tuple[str, int]] = []
    r = PodRunner(
        OnePod(), "ns", tmp_path / "pods", tmp_path / "bin", on_start=lambda p: seen.append((p.name, p.proc.pid))
    )  # type: ignore[arg-type]
    try:
        r.sync()
        r.sync()
        assert seen == [("p", r.processes("p")[0].proc.pid)]
    finally:
        r.stop()


def test_vllm_pods_run_from_the_vllm_omni_env_with_the_cpu_plugin(tmp_path: Path) -> None:
    env_dir = tmp_path / "vllm-omni-env"
    (env_dir / "bin").mkdir(parents=True)
    out = tmp_path / "vllm.txt"
    fake = env_dir / "bin" / "vllm"
    fake.write_text(f'#!/bin/sh\necho "$0 $*" > {out}; env | sort >> {out}; echo END >> {out}\n')
    fake.chmod(0o755)
    r = runner(tmp_path, env_dir)
    proc = r._launch(pod("stage", ["vllm", "serve", "/m", "--omni", "--host", "0.0.0.0"]))
    try:
        text = wait_for(out)
    finally:
        r._terminate(proc)
    lines = text.splitlines()
    assert lines[0] == f"{fake} serve /m --omni --host 127.0.0.9"
    env = dict(line.split("=", 1) for line in lines[1:-1] if "=" in line)
    for key, value in VLLM_OMNI_CPU_ENV.items():
        assert env[key] == value
    assert "PYTHONPATH" not in env
    assert env["PATH"].split(os.pathsep)[0] == str(env_dir / "bin")


def test_stopping_a_pod_stops_the_children_it_started(tmp_path: Path) -> None:
    out = tmp_path / "child.txt"
    # The shell starts a child and waits; the child ignores nothing, but only the group signal reaches it.
    script = f"sleep 300 & echo $! > {out}; echo END >> {out}; wait"
    r = runner(tmp_path)
    proc = r._launch(pod("parent", ["sh", "-c", script]))
    child = int(wait_for(out).splitlines()[0])
    assert Path(f"/proc/{child}").exists()
    r._terminate(proc)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{child}").exists()
