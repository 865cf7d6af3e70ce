"""The test bed's pod runner: private /dev/shm per pod, kubelet-style env, vLLM-Omni pods, group stop."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from omnimodel_testbed.kubeapi import ApiError
from omnimodel_testbed.kubelet import PodProcess, PodRunner, expand_env_refs, is_vllm_omni, shm_size
from omnimodel_testbed.runnerpods import RUNNER_LABEL
from omnimodel_testbed.vllm_omni import VLLM_OMNI_CPU_ENV


class FakeKube:
    """The few API calls a runner's sync makes, over pods held here; status patches are recorded."""

    def __init__(self, *pods: dict[str, Any], claims: list[dict[str, Any]] | None = None) -> None:
        self.pods = {p["metadata"]["name"]: p for p in pods}
        self.claims = claims or []
        self.patches: list[tuple[str, dict[str, Any]]] = []
        self.events: list[dict[str, Any]] = []
        self.removed: list[tuple[str, int]] = []

    def get(self, path: str) -> dict[str, Any]:
        if path == "/api/v1/namespaces/ns/pods":
            return {"items": list(self.pods.values())}
        if path == "/api/v1/namespaces/ns/persistentvolumeclaims":
            return {"items": self.claims}
        if path.startswith("/api/v1/namespaces/ns/persistentvolumeclaims/"):
            raise ApiError("GET", path, 404, "not bound here: the runner's own directory for the claim")
        raise AssertionError(f"unexpected API call GET {path}")

    def create(self, path: str, obj: dict[str, Any]) -> dict[str, Any]:
        assert path == "/api/v1/namespaces/ns/events", path
        self.events.append(obj)
        return obj

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """The runner's removal of a deleted pod (``DELETE`` with its options)."""
        assert method == "DELETE" and body is not None, (method, body)
        name = path.removeprefix("/api/v1/namespaces/ns/pods/")
        assert body["preconditions"]["uid"] == self.pods[name]["metadata"]["uid"]
        self.removed.append((name, body["gracePeriodSeconds"]))
        return self.pods.pop(name)

    def reasons(self) -> list[str]:
        return [f"{e['reason']}: {e['message']}" for e in self.events]

    def patch(self, path: str, patch: dict[str, Any], *, strategic: bool = False) -> dict[str, Any]:
        name = path.removeprefix("/api/v1/namespaces/ns/pods/").removesuffix("/status")
        assert path.endswith("/status") and strategic, path
        self.patches.append((name, patch["status"]))
        self.pods[name]["status"] = {**self.pods[name]["status"], **patch["status"]}
        return self.pods[name]


def runner_pod(name: str, command: list[str], **spec: Any) -> dict[str, Any]:
    """A pod as a runner finds it: labelled at admission, given an IP by kwok, still Pending."""
    p = pod(name, command, **spec)
    p["metadata"]["labels"] = {RUNNER_LABEL: "true"}
    p["status"] = {"phase": "Pending", "podIP": "127.0.0.9", "hostIP": "127.0.0.1"}
    return p


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


def launch(r: PodRunner, p: dict[str, Any]) -> PodProcess:
    """Start the pod's first container as the runner does once its init containers are done."""
    root = r.workdir / p["metadata"]["name"]
    root.mkdir(parents=True, exist_ok=True)
    return r._start(p, p["spec"]["containers"][0], r._volumes(p, root), root, init=False)


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
    env: list[dict[str, Any]] = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "ADDR", "value": "tcp://$(POD_IP):5000"},
    ]
    r = runner(tmp_path)
    proc = launch(r, pod("head", ["sh", "-c", script], env=env))
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
    proc = launch(r, pod("p", ["sh", "-c", f'echo "$PYTHONPATH" > {out}; echo END >> {out}']))
    try:
        line = wait_for(out).splitlines()[0]
    finally:
        r._terminate(proc)
    assert line == f"{Path.cwd() / 'runtime'}:{Path.cwd() / 'e2e'}"


def test_sync_reports_each_started_process_once(tmp_path: Path) -> None:
    """What `make demo` records to stop pods by PID even if the process that ran them died."""
    api = FakeKube(runner_pod("p", ["sleep", "60"]))
    seen: list[tuple[str, int]] = []
    r = PodRunner(
        api,  # type: ignore[arg-type]
        "ns",
        tmp_path / "pods",
        tmp_path / "bin",
        on_start=lambda p: seen.append((p.name, p.proc.pid)),
    )
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
    proc = launch(r, pod("stage", ["vllm", "serve", "/m", "--omni", "--host", "0.0.0.0"]))
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
    proc = launch(r, pod("parent", ["sh", "-c", script]))
    child = int(wait_for(out).splitlines()[0])
    assert Path(f"/proc/{child}").exists()
    r._terminate(proc)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{child}").exists()


def run_pod(tmp_path: Path, p: dict[str, Any], done: Callable[[dict[str, Any]], bool]) -> tuple[FakeKube, PodRunner]:
    """Sync a runner over ``p`` until its status satisfies ``done`` (what the real loop does every 0.3 s)."""
    api = FakeKube(p)
    r = PodRunner(api, "ns", tmp_path / "pods", tmp_path / "bin")  # type: ignore[arg-type]
    deadline = time.monotonic() + 20
    try:
        while time.monotonic() < deadline:
            r.sync()
            if done(api.pods[p["metadata"]["name"]]["status"]):
                return api, r
            time.sleep(0.05)
    finally:
        r.stop()
    raise AssertionError(f"pod status never got there: {api.pods[p['metadata']['name']]['status']}")


def finished(status: dict[str, Any]) -> bool:
    return status.get("phase") in ("Succeeded", "Failed")


def test_a_job_pod_runs_its_init_container_first_and_fails_with_the_exit_code_and_message(tmp_path: Path) -> None:
    order = tmp_path / "order.txt"
    p = runner_pod(
        "fetch",
        [
            "sh",
            "-c",
            f'echo main >> {order}; echo "Unauthorized: 401 Invalid credentials" > $0; exit 3',
            "/dev/termination-log",
        ],
        restartPolicy="Never",
        initContainers=[{"name": "prepare", "command": ["sh", "-c", f"echo init >> {order}"]}],
    )
    api, _ = run_pod(tmp_path, p, finished)
    status = api.pods["fetch"]["status"]
    assert order.read_text() == "init\nmain\n"
    assert status["phase"] == "Failed"
    (init,) = status["initContainerStatuses"]
    assert init["state"]["terminated"]["exitCode"] == 0
    (main,) = status["containerStatuses"]
    term = main["state"]["terminated"]
    assert (term["exitCode"], term["reason"], term["message"]) == (
        3,
        "Error",
        "Unauthorized: 401 Invalid credentials\n",
    )
    # What the Job controller saw on the way: Pending while the init container ran, then Running.
    phases = [patch["phase"] for name, patch in api.patches if name == "fetch"]
    assert phases[0] == "Pending" and "Running" in phases and phases[-1] == "Failed"


def test_a_failed_init_container_fails_a_never_pod_before_its_container_starts(tmp_path: Path) -> None:
    marker = tmp_path / "main-ran"
    p = runner_pod(
        "stage",
        ["touch", str(marker)],
        restartPolicy="Never",
        initContainers=[{"name": "wait-weights", "command": ["sh", "-c", "exit 1"]}],
    )
    api, _ = run_pod(tmp_path, p, finished)
    status = api.pods["stage"]["status"]
    assert status["phase"] == "Failed"
    assert status["initContainerStatuses"][0]["state"]["terminated"]["exitCode"] == 1
    assert "waiting" in status["containerStatuses"][0]["state"]
    assert not marker.exists()


def test_fallback_to_logs_on_error_gives_the_logs_tail_when_the_file_stays_empty(tmp_path: Path) -> None:
    p = runner_pod(
        "crash",
        ["sh", "-c", "echo starting; echo 'Traceback: boom' >&2; exit 1"],
        restartPolicy="Never",
        container={"terminationMessagePolicy": "FallbackToLogsOnError"},
    )
    api, _ = run_pod(tmp_path, p, finished)
    term = api.pods["crash"]["status"]["containerStatuses"][0]["state"]["terminated"]
    assert term["message"] == "starting\nTraceback: boom\n"


def test_on_failure_restarts_the_container_in_place_and_counts(tmp_path: Path) -> None:
    tries = tmp_path / "tries"
    # Fails the first time, succeeds the second (the kubelet's first restart comes at once).
    script = f"echo x >> {tries}; [ $(wc -l < {tries}) -ge 2 ]"
    p = runner_pod("retry", ["sh", "-c", script], restartPolicy="OnFailure")
    api, _ = run_pod(tmp_path, p, finished)
    status = api.pods["retry"]["status"]
    assert status["phase"] == "Succeeded"
    (main,) = status["containerStatuses"]
    assert main["restartCount"] == 1
    assert main["state"]["terminated"]["exitCode"] == 0


def test_a_read_only_claim_is_read_only_for_the_pod_and_writable_for_others(tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    script = (
        'cat "$0/weights.txt" > "$1"; if touch "$0/new" 2>/dev/null; then echo wrote; else echo refused; fi >> "$1"'
    )
    p = runner_pod(
        "reader",
        ["sh", "-c", script, "/models", str(out)],
        restartPolicy="Never",
        volumes=[{"name": "model-cache", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}}],
        container={"volumeMounts": [{"name": "model-cache", "mountPath": "/models", "readOnly": True}]},
    )
    claim = tmp_path / "pods" / "_claims" / "ns" / "weights"
    claim.mkdir(parents=True)
    (claim / "weights.txt").write_text("tensors\n")
    api, _ = run_pod(tmp_path, p, finished)
    assert api.pods["reader"]["status"]["phase"] == "Succeeded"
    assert out.read_text() == "tensors\nrefused\n"  # the in-container path named the claim's directory
    (claim / "new").write_text("")  # read-only only inside the pod's mount namespace


def test_a_tmp_volume_is_the_containers_tmpdir(tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    p = runner_pod(
        "tmp",
        ["sh", "-c", f'echo "$TMPDIR" > {out}; readlink -f "$TMPDIR" >> {out}'],
        restartPolicy="Never",
        volumes=[{"name": "tmp", "emptyDir": {}}],
        container={"volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}]},
    )
    run_pod(tmp_path, p, finished)
    tmpdir, resolved = out.read_text().split()
    assert Path(resolved) == (tmp_path / "pods" / "tmp" / "volumes" / "tmp").resolve()
    # Short, as /tmp is in a container: a Unix socket under it (vLLM's ZMQ IPC) fits in 107 bytes.
    assert len(f"{tmpdir}/5c978b73-5228-4388-b3f5-6c07924a8bdc") <= 107


def sync_until(
    r: PodRunner, api: FakeKube, name: str, done: Callable[[dict[str, Any]], Any], timeout: float = 20
) -> Any:
    """Sync ``r`` (as its loop does every 0.3 s) until ``done`` holds for the pod's status; return its value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r.sync()
        value = done(api.pods[name]["status"])
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"pod {name} never got there: {api.pods[name]['status']}")


def main_status(status: dict[str, Any]) -> dict[str, Any]:
    statuses: list[dict[str, Any]] = status.get("containerStatuses") or [{}]
    return statuses[0]


def condition(status: dict[str, Any], type_: str) -> str:
    return next((c["status"] for c in status.get("conditions") or [] if c["type"] == type_), "")


def test_a_readiness_probe_keeps_the_pod_unready_until_it_passes(tmp_path: Path) -> None:
    flag = tmp_path / "ready"
    probe = {"exec": {"command": ["test", "-f", str(flag)]}, "periodSeconds": 1}
    api = FakeKube(runner_pod("web", ["sleep", "60"], container={"readinessProbe": probe}))
    r = PodRunner(api, "ns", tmp_path / "pods", tmp_path / "bin")  # type: ignore[arg-type]
    try:
        sync_until(r, api, "web", lambda s: "Readiness probe failed: " in "".join(api.reasons()))
        status = api.pods["web"]["status"]
        assert "running" in main_status(status)["state"] and not main_status(status)["ready"]
        assert (condition(status, "ContainersReady"), condition(status, "Ready")) == ("False", "False")
        flag.touch()
        sync_until(r, api, "web", lambda s: condition(s, "Ready") == "True")
        assert main_status(api.pods["web"]["status"])["ready"]
    finally:
        r.stop()


def test_a_liveness_failure_kills_and_restarts_an_always_container(tmp_path: Path) -> None:
    tries = tmp_path / "tries"
    probe = {"exec": {"command": ["test", "-f", str(tmp_path / "alive")]}, "periodSeconds": 1, "failureThreshold": 2}
    p = runner_pod("stuck", ["sh", "-c", f"echo x >> {tries}; exec sleep 60"], container={"livenessProbe": probe})
    api = FakeKube(p)
    r = PodRunner(api, "ns", tmp_path / "pods", tmp_path / "bin")  # type: ignore[arg-type]
    try:
        main = sync_until(r, api, "stuck", lambda s: main_status(s).get("restartCount") == 1 and main_status(s))
        assert main["lastState"]["terminated"]["exitCode"] == 143  # SIGTERM: 128 + 15
        assert "Killing: Container main failed liveness probe, will be restarted" in api.reasons()
        assert api.reasons().count("Unhealthy: Liveness probe failed: command ['test', '-f', "
                                   f"'{tmp_path / 'alive'}'] exited with 1") >= 2  # fmt: skip
        # Started again: the command ran a second time.
        sync_until(r, api, "stuck", lambda s: "running" in main_status(s)["state"] and tries.read_text() == "x\nx\n")
    finally:
        r.stop()


def test_an_always_container_that_crashes_is_restarted_with_back_off(tmp_path: Path) -> None:
    api = FakeKube(runner_pod("crash", ["sh", "-c", "echo boom > $0; exit 1", "/dev/termination-log"]))
    r = PodRunner(api, "ns", tmp_path / "pods", tmp_path / "bin")  # type: ignore[arg-type]
    try:
        # The first restart comes at once, the second after 10 s: meanwhile CrashLoopBackOff.
        main = sync_until(r, api, "crash", lambda s: main_status(s).get("restartCount") == 2 and main_status(s))
        assert main["state"]["waiting"]["reason"] == "CrashLoopBackOff"
        assert "back-off 10s" in main["state"]["waiting"]["message"]
        ended = main["lastState"]["terminated"]
        assert (ended["exitCode"], ended["reason"], ended["message"]) == (1, "Error", "boom\n")
        assert condition(api.pods["crash"]["status"], "Ready") == "False"
        assert api.pods["crash"]["status"]["phase"] == "Running"
    finally:
        r.stop()


def _trapping(out: Path, *, on_term: str = "exit 0") -> list[str]:
    """A container that notes its SIGTERM in ``out``, then does ``on_term``."""
    return ["sh", "-c", f'trap "echo TERM >> {out}; {on_term}" TERM; echo up >> {out}; while :; do sleep 0.1; done']


def test_a_deleted_pods_prestop_hook_runs_before_its_sigterm(tmp_path: Path) -> None:
    out = tmp_path / "order"
    hook = {"exec": {"command": ["sh", "-c", f"sleep 0.5; echo hook >> {out}"]}}
    api = FakeKube(runner_pod("drain", _trapping(out), container={"lifecycle": {"preStop": hook}}))
    r = PodRunner(api, "ns", tmp_path / "pods", tmp_path / "bin")  # type: ignore[arg-type]
    try:
        sync_until(r, api, "drain", lambda s: out.exists())
        del api.pods["drain"]  # deleted (kwok removes the object at once)
        r.sync()
        deadline = time.monotonic() + 20
        while out.read_text().count("\n") < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert out.read_text() == "up\nhook\nTERM\n"
        assert "Killing: Stopping container main" in api.reasons()
    finally:
        r.stop()


def test_a_failed_prestop_hook_is_an_event_and_the_grace_period_counts_from_the_hook(tmp_path: Path) -> None:
    out = tmp_path / "order"
    # The hook fails at once; the second container's hook sleeps past the grace period, which bounds it.
    failing = {"exec": {"command": ["sh", "-c", "echo no drain; exit 3"]}}
    api = FakeKube(
        runner_pod("fail", _trapping(out), container={"lifecycle": {"preStop": failing}}),
        runner_pod(
            "slow",
            _trapping(tmp_path / "slow", on_term="true"),  # ignores SIGTERM: SIGKILL ends it
            terminationGracePeriodSeconds=1,
            container={"lifecycle": {"preStop": {"sleep": {"seconds": 60}}}},
        ),
    )
    api.pods["slow"]["status"]["podIP"] = "127.0.0.10"
    r = PodRunner(api, "ns", tmp_path / "pods", tmp_path / "bin")  # type: ignore[arg-type]
    try:
        sync_until(r, api, "fail", lambda s: out.exists() and (tmp_path / "slow").exists())
        slow = r.processes("slow")[0].proc
        del api.pods["fail"], api.pods["slow"]
        begin = time.monotonic()
        r.sync()
        deadline = begin + 20
        while (slow.poll() is None or "TERM" not in out.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        took = time.monotonic() - begin
        assert out.read_text() == "up\nTERM\n"
        assert slow.returncode == -9, slow.returncode  # SIGKILLed after what was left of its grace (2 s at least)
        assert 2.5 < took < 10, took  # 1 s of hook (its grace period), then the kubelet's least 2 s
        (failed,) = [m for m in api.reasons() if m.startswith("FailedPreStopHook")]
        assert "Exec lifecycle hook (['sh', '-c', 'echo no drain; exit 3']) for Container \"main\"" in failed
        assert failed.endswith("failed - error: no drain\n")
    finally:
        r.stop()


def test_a_pod_being_deleted_stays_until_its_container_stopped_and_the_runner_removes_it(tmp_path: Path) -> None:
    out = tmp_path / "order"
    hook = {"httpGet": {"path": "/drain", "port": "http"}}  # nothing listens: the hook fails, the kill goes on
    p = runner_pod(
        "web",
        _trapping(out, on_term="sleep 1; echo stopped >> " + str(out) + "; exit 0"),
        container={"lifecycle": {"preStop": hook}, "ports": [{"name": "http", "containerPort": 1}]},
    )
    api = FakeKube(p)
    r = PodRunner(api, "ns", tmp_path / "pods", tmp_path / "bin")  # type: ignore[arg-type]
    try:
        sync_until(r, api, "web", lambda s: out.exists())
        # What the API server does with `kubectl delete pod web`: a timestamp and a grace period, the object stays.
        api.pods["web"]["metadata"].update(deletionTimestamp="2026-12-07T20:00:30Z", deletionGracePeriodSeconds=30)
        r.sync()
        assert "web" in api.pods and r.processes("web") == []  # terminating: no longer one of the runner's
        deadline = time.monotonic() + 20
        while "web" in api.pods and time.monotonic() < deadline:
            r.sync()
            time.sleep(0.05)
        assert api.removed == [("web", 0)]
        assert out.read_text() == "up\nTERM\nstopped\n"  # removed only once the container had stopped
        (failed,) = [m for m in api.reasons() if m.startswith("FailedPreStopHook")]
        assert "HTTP lifecycle hook (/drain)" in failed and "connection refused" in failed
    finally:
        r.stop()


def test_a_deleted_pod_that_runs_nothing_is_removed_at_once(tmp_path: Path) -> None:
    p = runner_pod("done", ["true"], restartPolicy="Never")
    api = FakeKube(p)
    r = PodRunner(api, "ns", tmp_path / "pods", tmp_path / "bin")  # type: ignore[arg-type]
    try:
        sync_until(r, api, "done", finished)
        api.pods["done"]["metadata"].update(deletionTimestamp="2026-12-07T20:00:30Z", deletionGracePeriodSeconds=30)
        r.sync()
        r.sync()
        assert api.removed == [("done", 0)]
    finally:
        r.stop()


def test_an_exec_handler_runs_as_the_container_with_the_pods_loopback_at_its_ip(tmp_path: Path) -> None:
    """In a cluster a pod's exec probe reaches its own servers at 127.0.0.1; here they listen on the pod's IP."""
    r = runner(tmp_path)
    proc = launch(r, pod("head", ["sleep", "60"], env=[{"name": "PORT", "value": "8000"}]))
    try:
        assert proc.target is not None
        argv = proc.target.exec_argv(["sh", "-c", 'echo "http://127.0.0.1:$PORT/health"'])
        out = subprocess.run(argv, env=dict(proc.target.env), capture_output=True, text=True, check=True).stdout
        assert out == "http://127.0.0.9:8000/health\n"
    finally:
        r._terminate(proc)
