"""``make demo``: the operator deploys two tiny OmniModels on the local control plane, and we talk to them.

What runs, in two processes:

- **outside** (this host's network): the control-plane binaries are checked (and built on first use,
  which needs the network for Go modules); then everything else runs in a child process inside a
  private network namespace (:mod:`omnimodel_testbed.netns`). When that child ends, however it ends,
  this process stops by PID whatever it left (cluster components from ``state.json``, pod and operator
  processes from ``demo/processes.json``) and checks that no process is left in the namespace, so the
  namespace is gone.
- **inside** the namespace: the cluster (etcd, kube-apiserver, controller-manager, scheduler, kwok with
  the fake accelerator fleet, and the OCI registry ``make images`` pushed to), the test bed's cluster DNS,
  ``helm install`` of the operator chart with the images' names computed from its values, the operator
  pod run from the operator image by the test bed's kubelet (``operator_pod.py``, as ``e2e/serving``
  does), the pod runner (every pod of the ``demo`` namespace from its image, on its pod IP), the two
  OmniModels from ``examples/``, requests with the official ``openai`` client through each gateway's
  Service name, a scale-out, and the teardown.

The fake nodes have no devices: the pod runner starts every stage on this machine's CPU
(``OMNIMODEL_DEVICE=cpu``) whatever vendor the scheduler placed it on; requests, node selectors,
tolerations and placement are the real ones.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import io
import json
import logging
import os
import re
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
import traceback
import wave
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

import httpx
import openai
import yaml

from . import procs
from .binaries import Toolchain, cache_root, ensure_built, expected_dir, kubectl_binary, missing_binaries
from .cluster import Cluster, ClusterError, ClusterState
from .dns import ClusterDNS, service_addresses
from .kubelet import PodProcess, PodRunner
from .netns import CLUSTER_DNS, NETNS_POD_CIDR, netns_argv, run_passing_signals
from .operator_pod import RELEASE, RELEASE_NAMESPACE, OperatorPod, image_store, service_env
from .progress import Reporter, StepError
from .registry import RegistryImages
from .vllm_omni import ensure_env as ensure_vllm_omni_env

__all__ = ["DEMO_MODELS", "STEPS", "enter", "processes_in_netns", "run"]

REPO = Path(__file__).resolve().parents[2]
NAMESPACE = "demo"
GATEWAY_PORT = 8000
STAGE_PORT = 8001


@dataclass(frozen=True)
class DemoModel:
    """One OmniModel the demo deploys: an example file and the stage it scales (if any)."""

    example: str
    name: str


# The OmniModels, straight from examples/ (so `kubectl apply -f` of the same files works anywhere). With
# --vllm-omni (DEMO_VLLM_OMNI=1) a third one runs on vLLM-Omni's own engines: it needs the cached vLLM-Omni
# environment (built on first use, about 2 minutes) and its start-up adds about a minute.
OMNI = DemoModel("qwen-omni-tiny.yaml", "omni-tiny")
IMAGE = DemoModel("text-to-image-tiny.yaml", "image-tiny")
VLLM_IMAGE = DemoModel("vllm-omni-image-tiny.yaml", "vllm-image")
DEMO_MODELS = (OMNI, IMAGE)
SCALED_STAGE = "thinker"

#: The whole plan; both processes number their steps from it.
STEPS: tuple[tuple[str, str], ...] = (
    ("binaries", "Control-plane binaries (built from e2e/cluster/go.mod on first use)"),
    ("cluster", "Start the control plane in a private network namespace"),
    ("chart", "helm install the operator chart, its images named through its values"),
    ("operator", "The operator pod runs from its image, pulled from the test bed's registry"),
    ("apply", "kubectl apply two tiny OmniModels whose stages span four accelerator vendors"),
    ("ready", "Wait until both are Ready and every stage pod has loaded its model"),
    ("chat", "Chat through the gateway Service with the official openai client"),
    ("audio", "Chat with audio: thinker -> talker -> code2wav, saved as a WAV file"),
    ("image", "An image from the text-to-image OmniModel, saved as a PNG file"),
    ("scale", f"Scale the {SCALED_STAGE} to 2 replicas; the new pod takes traffic"),
    ("vllm-omni", "With --vllm-omni: images from vLLM-Omni's head and its headless replica, one pod each"),
    ("teardown", "Tear down"),
)

log = logging.getLogger("omnimodel_testbed")
T = TypeVar("T")


def default_demo_state_dir() -> Path:
    """``$OMNIMODEL_TESTBED_STATE_DIR`` or ``<cache>/demo`` (never the shared ``make cluster-up`` one)."""
    env = os.environ.get("OMNIMODEL_TESTBED_STATE_DIR")
    return Path(env) if env else cache_root() / "demo"


@dataclass(frozen=True)
class Paths:
    """Where one demo run keeps its files (inside the test-bed state dir)."""

    state_dir: Path
    out: Path

    @property
    def demo(self) -> Path:
        return self.state_dir / "demo"

    @property
    def inner(self) -> Path:
        """PID, start time and network namespace of the process inside the namespace."""
        return self.demo / "inner.json"

    @property
    def records(self) -> Path:
        """Every pod and operator process started, for the outside process's final sweep."""
        return self.demo / "processes.json"

    @property
    def pods(self) -> Path:
        return self.demo / "pods"

    @property
    def lock(self) -> Path:
        return self.demo / "lock"


def run(args: argparse.Namespace, state_dir: Path | None) -> int:
    """Entry point of ``demo``; returns the exit status (130 after Ctrl-C)."""
    sd = (state_dir or default_demo_state_dir()).resolve()
    paths = Paths(sd, (args.out or sd / "output").resolve())
    if args.inside:
        return _Inside(args, paths).run()
    return _outside(args, paths)


# ====================================================================================== outside


def _outside(args: argparse.Namespace, paths: Paths) -> int:
    t0 = time.time()
    reporter = Reporter(STEPS, t0=t0)
    paths.demo.mkdir(parents=True, exist_ok=True)
    with paths.lock.open("w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"another demo is running with state dir {paths.state_dir} (stop it with Ctrl-C there)")
            return 1
        try:
            return _outside_locked(args, paths, reporter, t0)
        finally:
            reporter.close()


def _outside_locked(args: argparse.Namespace, paths: Paths, reporter: Reporter, t0: float) -> int:
    live = _live_cluster(paths.state_dir)
    if live:
        print(
            f"{paths.state_dir} records a running cluster ({live}); the demo starts its own. Stop that one "
            f"(python -m omnimodel_testbed --state-dir {paths.state_dir} down) or pass another --state-dir."
        )
        return 1
    reporter.headline(f"OmniModel demo (state and logs: {paths.state_dir})")
    cached = bool(os.environ.get("OMNIMODEL_TESTBED_TOOLCHAIN")) or Toolchain(expected_dir()).complete()
    try:
        # A cold build takes minutes (COLD_BUILD_SECONDS); its own progress lines say how far it is.
        with reporter.step("binaries", slow_after=30 if cached else 900, look_at=[str(expected_dir())]):
            _binaries(reporter, cached)
    except KeyboardInterrupt:
        reporter.headline("Interrupted while building; nothing was started.")
        return 130
    except Exception as err:
        reporter.headline(f"FAILED: {err}")
        return 1

    for stale in (paths.inner, paths.records):
        stale.unlink(missing_ok=True)
    env = dict(os.environ)
    env.update(
        {
            "OMNIMODEL_TESTBED_POD_CIDR": NETNS_POD_CIDR,
            "OMNIMODEL_TESTBED_STATE_DIR": str(paths.state_dir),
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.pop("OMNIMODEL_KUBECONFIG", None)  # a host cluster is unreachable from inside
    if env.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in env["PYTHONPATH"].split(os.pathsep) if p)
    resolv_conf = paths.demo / "resolv.conf"
    resolv_conf.write_text(f"nameserver {CLUSTER_DNS[0]}\noptions timeout:2 attempts:3\n")
    inner_cmd = [
        sys.executable, "-m", "omnimodel_testbed", "--state-dir", str(paths.state_dir), "demo", "--inside",
        "--t0", repr(t0), "--out", str(paths.out), *(["--keep"] if args.keep else []),
        *(["--vllm-omni"] if getattr(args, "vllm_omni", False) else []),
    ]  # fmt: skip
    # A Ctrl-C at the terminal reaches both processes, a signal for this one is passed on: the inside
    # process tears down (it ignores the duplicate), this one waits for it and then sweeps.
    rc = run_passing_signals(
        netns_argv(inner_cmd, resolv_conf, NETNS_POD_CIDR),
        env,
        {signal.SIGINT: signal.SIGINT, signal.SIGTERM: signal.SIGINT},
    )
    return _sweep(paths, reporter, rc)


def _binaries(reporter: Reporter, cached: bool) -> Toolchain:
    if not cached:
        missing = missing_binaries()
        reporter.say(
            f"not built yet: {', '.join(missing)}; building from the pinned Go modules (first run only: all six "
            "took 5 to 9 min here on 2 cores, Go module download included)"
        )
    # Build heartbeats more often than the step's own (15 s), so only the build's say what compiles.
    tc = ensure_built(out=reporter.say, heartbeat=10.0)
    reporter.say(f"{'cached' if cached else 'built'}: {tc.bin_dir}")
    return tc


def _live_cluster(state_dir: Path) -> str:
    st = Cluster(state_dir).load_state()
    alive = [f"{p.name} pid {p.pid}" for p in (st.processes if st else ()) if procs.is_alive(p)]
    return ", ".join(alive)


def _sweep(paths: Paths, reporter: Reporter, rc: int) -> int:
    """Stop by PID whatever the inside process left, then check that its network namespace is gone."""
    left: list[str] = [f"{r.name} (pid {r.pid})" for r in Cluster(paths.state_dir).down()]
    records = _load_records(paths.records)
    left += [f"{r.name} (pid {r.pid})" for r in procs.stop(records, grace=10)]
    netns = _inner_netns(paths)
    stragglers = processes_in_netns(netns) if netns else []
    for pid in stragglers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        left.append(f"pid {pid} in the demo's network namespace")
    deadline = time.monotonic() + 10
    while netns and processes_in_netns(netns) and time.monotonic() < deadline:
        time.sleep(0.1)
    remaining = processes_in_netns(netns) if netns else []
    if left:
        reporter.headline(f"!! the inside process left {len(left)} behind, stopped now by PID: {', '.join(left)}")
    if remaining:
        reporter.headline(f"!! processes still in network namespace {netns}: {remaining}")
        return rc or 1
    reporter.headline(
        f"Nothing left behind: no process of the demo runs, its network namespace {netns or '(never made)'} is gone."
    )
    if left and rc == 0:
        return 1
    return rc


def _load_records(path: Path) -> list[procs.ProcessRecord]:
    try:
        return [procs.ProcessRecord.from_json(r) for r in json.loads(path.read_text())]
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def _inner_netns(paths: Paths) -> str | None:
    try:
        return str(json.loads(paths.inner.read_text())["netns"])
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return None


def processes_in_netns(netns: str) -> list[int]:
    """PIDs of every process (that we may inspect) in the network namespace ``netns`` (``net:[inode]``)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if os.readlink(entry / "ns" / "net") == netns:
                out.append(int(entry.name))
    return out


def enter(state_dir: Path | None, cmd: Sequence[str]) -> int:
    """Run ``cmd`` (default: a shell) in the namespaces of a running ``demo --keep``."""
    paths = Paths((state_dir or default_demo_state_dir()).resolve(), Path())
    try:
        info = json.loads(paths.inner.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        print(f"no demo recorded in {paths.state_dir} (start one with `make demo DEMO_KEEP=1`)", file=sys.stderr)
        return 1
    if not procs.is_alive(procs.ProcessRecord("demo", int(info["pid"]), int(info["start_ticks"]), "", "")):
        print(f"the demo recorded in {paths.state_dir} is not running any more", file=sys.stderr)
        return 1
    nsenter = shutil.which("nsenter") or shutil.which("nsenter", path="/usr/bin:/bin:/usr/sbin:/sbin")
    if nsenter is None:
        print("`nsenter` not found (util-linux)", file=sys.stderr)
        return 1
    env = dict(os.environ)
    env["KUBECONFIG"] = str(paths.state_dir / "admin.kubeconfig")
    env["KUBECACHEDIR"] = str(paths.demo / "kube-cache")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    # The demo has a user namespace of its own only when started by a user other than root (netns.py);
    # nsenter refuses to re-enter the one it is in.
    pid = str(info["pid"])
    own_user_ns = os.readlink(f"/proc/{pid}/ns/user") != os.readlink("/proc/self/ns/user")
    user = ["-U"] if own_user_ns else []
    argv = [nsenter, "-t", pid, *user, "-n", "-m", "--", *(cmd or [env.get("SHELL", "/bin/sh")])]
    return subprocess.run(argv, env=env, check=False).returncode


# ======================================================================================= inside


class _Interrupts:
    """SIGINT/SIGTERM: the first one interrupts the main thread; later ones (and any during teardown)
    only say that teardown is under way, so it always runs to the end."""

    def __init__(self, reporter: Reporter) -> None:
        self.reporter = reporter
        self.first: float | None = None
        self.tearing_down = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if self.first is None and not self.tearing_down:
            self.first = now
            raise KeyboardInterrupt
        # A Ctrl-C at the terminal arrives twice: from the terminal and forwarded by the outside process.
        if self.first is None or now - self.first > 1.0:
            name = signal.Signals(signum).name
            self.reporter.headline(f"({name}: tearing down already; every process is stopped by PID)")


class _Inside:
    def __init__(self, args: argparse.Namespace, paths: Paths) -> None:
        self.args = args
        self.paths = paths
        self.vllm_omni = bool(getattr(args, "vllm_omni", False))
        self.models = (*DEMO_MODELS, VLLM_IMAGE) if self.vllm_omni else DEMO_MODELS
        self.reporter = Reporter(STEPS, t0=args.t0)
        self.interrupts = _Interrupts(self.reporter)
        self.teardown = contextlib.ExitStack()
        self.records: list[procs.ProcessRecord] = []
        self._records_lock = threading.Lock()
        self.kubeconfig = Path()
        self.runner: PodRunner | None = None
        self.operator: OperatorPod | None = None
        self.state: ClusterState | None = None
        # kubectl's discovery cache and helm's homes in the state dir, not in ~/.kube and ~/.cache (each run
        # is a new cluster on new ports: a cache in the home directory would only pile up).
        self.kube_env = {**os.environ, "KUBECACHEDIR": str(paths.demo / "kube-cache")}
        self.helm_env = {
            **self.kube_env,
            **{f"HELM_{k.upper()}_HOME": str(paths.demo / "helm" / k) for k in ("cache", "config", "data")},
        }

    # --------------------------------------------------------------------------------- plumbing
    def run(self) -> int:
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, self.interrupts)
        _route_testbed_logs(self.reporter)
        me = procs.record("demo", os.getpid(), "")
        self.paths.inner.write_text(
            json.dumps({"pid": me.pid, "start_ticks": me.start_ticks, "netns": os.readlink("/proc/self/ns/net")})
        )
        shutil.rmtree(self.paths.pods, ignore_errors=True)
        rc = 0
        try:
            self.steps()
            if self.args.keep:
                self.keep()
        except KeyboardInterrupt:
            self.reporter.headline("Interrupted (Ctrl-C): tearing down.")
            rc = 130
        except StepError as err:
            self.reporter.headline(f"FAILED {err}")
            cause = err.__cause__
            if cause is not None and not isinstance(cause, StepError):
                trace = self.paths.demo / "traceback.txt"
                trace.write_text("".join(traceback.format_exception(cause)))
                self.reporter.headline(f"  traceback: {trace}")
            rc = 1
        except Exception:
            self.reporter.headline(f"FAILED with an unexpected error:\n{traceback.format_exc()}")
            rc = 1
        finally:
            self.interrupts.tearing_down = True
            self.tear_down()
            self.reporter.close()
        return rc

    def record(self, name: str, pid: int, log_path: Path) -> None:
        """Remember a started process (atomically on disk) for the outside process's final sweep."""
        with self._records_lock:
            with contextlib.suppress(RuntimeError):  # already gone: nothing to sweep
                self.records.append(procs.record(name, pid, log_path))
            tmp = self.paths.records.with_suffix(".tmp")
            tmp.write_text(json.dumps([r.to_json() for r in self.records]))
            tmp.replace(self.paths.records)

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True, timeout: float = 60) -> str:
        proc = subprocess.run(
            [kubectl_binary(), f"--kubeconfig={self.kubeconfig}", *args],
            input=stdin,
            capture_output=True,
            text=True,
            check=False,
            timeout=timeout,
            env=self.kube_env,
        )
        if check and proc.returncode != 0:
            raise StepError(f"kubectl {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc.stdout

    def show(self, *args: str) -> str:
        """Run kubectl and print the command and its output, as a user would see them."""
        out = self.kubectl(*args)
        self.reporter.say(f"$ kubectl {' '.join(args)}\n{out.rstrip()}")
        return out

    def pod_logs(self) -> list[str]:
        runner = self.runner
        logs = [f"{p.name}: {p.log_path}" for p in (runner.processes() if runner else [])]
        if self.operator is not None and (process := self.operator.process()) is not None:
            logs.append(f"operator: {process.log_path}")
        return [*logs, f"control plane: {self.paths.state_dir / 'logs'}"]

    def check_pods(self) -> None:
        """Fail at once when a pod's process has exited (the test bed never restarts one)."""
        for p in self.runner.processes() if self.runner else []:
            if p.proc.poll() is not None:
                tail = procs.log_tail(p.log_path, 25)
                raise StepError(f"pod {p.name}'s process exited with {p.proc.returncode}; {p.log_path}:\n{tail}")
        process = self.operator.process() if self.operator is not None else None
        if process is not None and process.proc.poll() is not None:
            tail = procs.log_tail(process.log_path, 25)
            raise StepError(f"the operator pod's process exited with {process.proc.returncode}:\n{tail}")

    def poll(self, what: str, predicate: Callable[[], T | None], timeout: float, interval: float = 0.5) -> T:
        def checked() -> T | None:
            self.check_pods()
            return predicate()

        return procs.poll(checked, timeout=timeout, what=what, interval=interval, error=StepError)

    # ------------------------------------------------------------------------------------ steps
    def steps(self) -> None:
        r = self.reporter
        with r.step("cluster", slow_after=40, look_at=[str(self.paths.state_dir / "logs")]):
            self.start_cluster()
        with r.step("chart", slow_after=60, look_at=self.pod_logs):
            self.install_chart()
        with r.step("operator", slow_after=30, look_at=self.pod_logs):
            self.start_operator()
        with r.step("apply", slow_after=30, look_at=self.pod_logs):
            self.apply_models()
        with r.step("ready", slow_after=120, look_at=self.pod_logs):
            self.wait_ready()
        with r.step("chat", slow_after=30, look_at=self.pod_logs):
            self.chat()
        with r.step("audio", slow_after=60, look_at=self.pod_logs):
            self.audio()
        with r.step("image", slow_after=60, look_at=self.pod_logs):
            self.image()
        with r.step("scale", slow_after=60, look_at=self.pod_logs):
            self.scale()
        if self.vllm_omni:
            with r.step("vllm-omni", slow_after=60, look_at=self.pod_logs):
                self.vllm_images()
        else:
            with r.step("vllm-omni", slow_after=60):
                r.say("skipped: run `make demo DEMO_VLLM_OMNI=1` to add an OmniModel on vLLM-Omni's own engines")

    def start_cluster(self) -> None:
        cluster = Cluster(self.paths.state_dir, pod_cidr=NETNS_POD_CIDR)
        self.reporter.status = "etcd, kube-apiserver, controller-manager, scheduler, kwok, then 6 fake nodes"
        try:
            state = cluster.up()
        except (ClusterError, procs.ReadinessTimeoutError) as err:
            raise StepError(str(err)) from err
        self.teardown.callback(self._stop_cluster, cluster)
        self.state = state
        self.kubeconfig = state.kubeconfig
        api = cluster.api(state)
        dns = ClusterDNS(partial(service_addresses, api), *CLUSTER_DNS)
        self.teardown.callback(dns.stop)
        self.reporter.say(
            f"ready in {state.ready_seconds:.1f}s: {state.server}, pod CIDR {state.pod_cidr} (local in here), "
            f"cluster DNS for <svc>.<ns>.svc on {CLUSTER_DNS[0]}"
        )
        self.show(
            "get", "nodes", "-L", "nvidia.com/gpu.product,amd.com/gpu.product-name,node.kubernetes.io/npu.chip.name"
        )
        self.runner = PodRunner(
            api,
            NAMESPACE,
            self.paths.pods,
            Path(sys.executable).parent,
            # Each pod runs its image from the test bed's registry, as uid 1000 (vLLM-Omni's from its env).
            images=image_store(state),
            service_env=service_env(state),
            # One model cache for all pods, as a shared PVC would be: each tiny model is built once.
            shared_dirs={"model-cache": cache_root() / "models"},
            extra_env={
                # The fake nodes have no devices: every stage runs on this machine's CPU.
                "OMNIMODEL_DEVICE": "cpu",
                "CUDA_VISIBLE_DEVICES": "",
                # Two cores for many processes: one torch thread each avoids thrashing.
                "OMP_NUM_THREADS": "1",
                "OMNIMODEL_HEALTH_INTERVAL": "0.5",
            },
            on_start=self._pod_started,
        )

    def _pod_started(self, pod: PodProcess) -> None:
        self.record(f"pod {pod.name}", pod.proc.pid, pod.log_path)
        self.reporter.say(f"pod {pod.name} is running here as pid {pod.proc.pid} on {pod.ip}")

    def _stop_cluster(self, cluster: Cluster) -> None:
        stopped = cluster.down()
        names = ", ".join(f"{r.name} ({r.pid})" for r in stopped)
        self.reporter.say(
            f"stopped the control plane (the chart's release and the OmniModels were in its etcd): {names}"
        )

    def install_chart(self) -> None:
        assert self.state is not None
        self.show("create", "namespace", NAMESPACE)
        operator = OperatorPod(
            self.state,
            Cluster(self.paths.state_dir).api(self.state),
            self.paths.demo / "operator",
            values=[f"--set=watchNamespaces={{{NAMESPACE}}}"],
            on_start=self._pod_started,
            helm_env=self.helm_env,
        )
        self.operator = operator
        self.teardown.callback(self._stop_operator, operator)
        images = RegistryImages.of(self.state)
        self.reporter.say(
            f"images: `make images` pushed them to the test bed's registry at 127.0.0.1:{images.port}; the chart\n"
            f"  names them through its values: {' '.join(images.chart_values()[:2])} (every vendor's stage image is\n"
            f"  the -cpu one here: the fake nodes have no devices)"
        )
        self.reporter.status = "helm installs the chart; its operator pod pulls its image"
        try:
            out = operator.install()
        except (RuntimeError, subprocess.TimeoutExpired) as err:
            raise StepError(str(err)) from err
        self.reporter.say(f"$ helm {' '.join(operator.helm_args)}")
        keep = ("NAME:", "NAMESPACE:", "STATUS:", "REVISION:")
        self.reporter.say("\n".join(ln for ln in out.splitlines() if ln.startswith(keep)))

    def start_operator(self) -> None:
        assert self.operator is not None
        self.reporter.status = "the operator pod: image pull, then kopf's /healthz"
        try:
            process = self.poll("the operator pod's /healthz", self._operator_healthy, timeout=300)
        except RuntimeError as err:
            raise StepError(str(err)) from err
        self.show(
            "get", "pods", "-n", RELEASE_NAMESPACE, "-o",
            "custom-columns=POD:.metadata.name,STATUS:.status.phase,NODE:.spec.nodeName,IMAGE:.status.containerStatuses[0].imageID",
        )  # fmt: skip
        pid = process.proc.pid
        self.reporter.say(
            f"the operator runs from its image as uid 1000 (pid {pid}, root {os.readlink(f'/proc/{pid}/root')}),\n"
            f"  as system:serviceaccount:{RELEASE_NAMESPACE}:{RELEASE} through its projected token;\n"
            f"  log {process.log_path}"
        )

    def _operator_healthy(self) -> PodProcess | None:
        assert self.operator is not None
        return self.operator.process() if self.operator.healthy() else None

    def _stop_operator(self, operator: OperatorPod) -> None:
        operator.uninstall()
        self.reporter.say("uninstalled the chart; the operator pod's process stopped")

    def apply_models(self) -> None:
        assert self.runner is not None
        self.runner.start()
        self.teardown.callback(self._stop_pods, self.runner)
        omni = (REPO / "examples" / OMNI.example).read_text()
        self.reporter.say(f"$ cat examples/{OMNI.example}\n{omni.rstrip()}")
        if self.vllm_omni:
            self.reporter.status = "building (or reusing) the vLLM-Omni environment and the tiny model it serves"
            ensure_vllm_omni_env()
            from omnimodel_runtime.tiny import ensure_tiny

            ensure_tiny("text-to-image", cache_root() / "models")
        files = [a for m in self.models for a in ("-f", f"examples/{m.example}")]
        out = self.kubectl("apply", "-n", NAMESPACE, *[str(REPO / f) if f != "-f" else f for f in files])
        self.reporter.say(f"$ kubectl apply -n {NAMESPACE} {' '.join(files)}\n{out.rstrip()}")

    def _stop_pods(self, runner: PodRunner) -> None:
        count = len(runner.processes())
        t = time.monotonic()
        runner.stop()
        self.reporter.say(
            f"stopped {count} pod processes (SIGTERM to each pod's process group) in {time.monotonic() - t:.1f}s"
        )

    def gateway(self, model: DemoModel) -> str:
        return f"http://{model.name}-gateway.{NAMESPACE}.svc:{GATEWAY_PORT}"

    def wait_ready(self) -> None:
        seen: dict[str, str] = {}

        def show_if_changed(key: str, args: Sequence[str], strip_age: bool) -> None:
            out = self.kubectl(*args).rstrip()
            compare = "\n".join(ln.rsplit(None, 1)[0] for ln in out.splitlines()) if strip_age else out
            if seen.get(key) != compare:
                seen[key] = compare
                self.reporter.say(f"$ kubectl {' '.join(args)}\n{out}")

        def all_ready() -> bool:
            show_if_changed("omni", ("get", "omni", "-n", NAMESPACE), strip_age=True)
            show_if_changed("pods", self._pods_args(), strip_age=False)
            pending = [m.name for m in self.models if not self.model_ready(m.name)]
            self.reporter.status = f"Ready=False: {', '.join(pending)}" if pending else ""
            return not pending

        self.reporter.status = "the operator creates each stage's Deployment; the scheduler places the pods"
        # vLLM-Omni's replica pod is ready only once the head has attached it (its probes ask the head):
        # its head starts, then the replica registers and loads; 4+ min here on 2 loaded cores.
        self.poll("both OmniModels Ready=True", all_ready, timeout=480 if self.vllm_omni else 180, interval=1.0)
        # The listing above was taken before the Ready check that passed, so it can still show a pod
        # Pending; list once more so the last listing a user reads is the one that matches Ready=True.
        show_if_changed("pods", self._pods_args(), strip_age=False)
        self.reporter.say(
            "Ready: every stage Deployment is available (kwok reports the pods ready at once). "
            "Now the gateways' /health, which stays 503 until every stage pod has loaded its model:"
        )

        def warm() -> bool:
            waiting = []
            for m in self.models:
                body = _health(self.gateway(m))
                if m is VLLM_IMAGE:
                    if body is None:  # vLLM-Omni's /health: 200 once every stage has a live replica
                        waiting.append(f"{m.name} (vLLM-Omni head and replica starting)")
                    continue
                if body is None or body.get("status") != "ok":
                    cold = [n for n, s in ((body or {}).get("stages") or {}).items() if not s.get("ready")]
                    waiting.append(f"{m.name} ({', '.join(cold) or 'gateway starting'})")
            self.reporter.status = f"loading: {'; '.join(waiting)}{self._last_log_lines()}" if waiting else ""
            return not waiting

        self.poll("every gateway /health 200 (all stages loaded and warm)", warm, timeout=300, interval=1.0)
        for m in self.models:
            if m is VLLM_IMAGE:
                self.reporter.say(f"{self.gateway(m)}/health: 200 (vLLM-Omni: every stage has a live replica)")
                continue
            body = _health(self.gateway(m)) or {}
            stages = ", ".join(f"{n} {len(s.get('endpoints', []))} endpoint(s)" for n, s in body["stages"].items())
            self.reporter.say(f"{self.gateway(m)}/health: 200 ({stages})")

    def _last_log_lines(self) -> str:
        assert self.runner is not None
        lines = []
        for p in self.runner.processes():
            tail = procs.log_tail(p.log_path, 1).strip()
            if tail and tail != "<no log>":
                lines.append(f"\n        {p.name}: {tail[:140]}")
        return "".join(lines)

    def _pods_args(self) -> tuple[str, ...]:
        return (
            "get", "pods", "-n", NAMESPACE, "--sort-by=.metadata.name", "-o",
            "custom-columns=POD:.metadata.name,STATUS:.status.phase,NODE:.spec.nodeName,IP:.status.podIP",
        )  # fmt: skip

    def model_ready(self, name: str) -> bool:
        obj = json.loads(self.kubectl("get", "omni", name, "-n", NAMESPACE, "-o", "json"))
        gen = obj["metadata"].get("generation")
        for c in (obj.get("status") or {}).get("conditions") or []:
            if c["type"] == "Ready":
                return bool(c["status"] == "True" and c.get("observedGeneration") == gen)
        return False

    def client(self, model: DemoModel) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.gateway(model)}/v1", api_key="demo", max_retries=0, timeout=120)

    def chat(self) -> None:
        client = self.client(OMNI)
        (model,) = [m.id for m in client.models.list().data]
        question = "Hello! Who are you?"
        self.reporter.say(f"client = OpenAI(base_url='{self.gateway(OMNI)}/v1')   # the gateway Service's name")
        self.reporter.say(f"user> {question}")
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": question}], max_tokens=16, seed=1
        )
        self.reporter.say(f"{model}> {(reply.choices[0].message.content or '').strip()}")
        usage = reply.usage
        self.reporter.say(
            f"({usage.completion_tokens if usage else '?'} tokens of random tiny weights: the words are noise, the "
            "path is real: gateway pod -> thinker pod; text-only chat never touches talker or code2wav)"
        )

    def audio(self) -> None:
        client = self.client(OMNI)
        model = client.models.list().data[0].id
        question = "Say something, out loud."
        self.reporter.say(f"user> {question}   (modalities=['text', 'audio'])")
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": question}],
            modalities=["text", "audio"],
            max_tokens=16,
            seed=1,
        )
        message = reply.choices[0].message
        if message.audio is None:
            raise StepError("the answer has no message.audio")
        data = base64.b64decode(message.audio.data)
        with wave.open(io.BytesIO(data)) as w:
            rate, channels, frames = w.getframerate(), w.getnchannels(), w.getnframes()
        if (rate, channels) != (24000, 1) or frames == 0:
            raise StepError(f"unexpected audio: {rate} Hz, {channels} channel(s), {frames} frames")
        self.paths.out.mkdir(parents=True, exist_ok=True)
        path = self.paths.out / "omni-answer.wav"
        path.write_bytes(data)
        self.reporter.say(f"{model}> {(message.content or '').strip()}")
        self.reporter.say(f"audio: {path}  ({frames / rate:.2f} s, {rate} Hz mono, 16-bit PCM WAV)")

    def image(self) -> None:
        client = self.client(IMAGE)
        (model,) = [m.id for m in client.models.list().data]
        prompt = "a lighthouse at dawn, watercolor"
        self.reporter.say(f"client.images.generate(model='{model}', prompt='{prompt}', size='64x64')")
        result = client.images.generate(
            model=model,
            prompt=prompt,
            size="64x64",
            response_format="b64_json",
            extra_body={"num_inference_steps": 4, "seed": 7},
        )
        if not result.data or not result.data[0].b64_json:
            raise StepError("the answer has no image")
        data = base64.b64decode(result.data[0].b64_json)
        width, height = png_size(data)
        self.paths.out.mkdir(parents=True, exist_ok=True)
        path = self.paths.out / "image.png"
        path.write_bytes(data)
        self.reporter.say(f"image: {path}  ({width}x{height} PNG; encode -> denoise (4 steps) -> decode, one pod each)")

    def vllm_images(self) -> None:
        """Four images through vLLM-Omni's API Service; the head's own log names the replica of each."""
        assert self.runner is not None
        client = self.client(VLLM_IMAGE)
        (model,) = [m.id for m in client.models.list().data]
        self.reporter.say(f"client.images.generate(model='{model}', ...) x4 through {self.gateway(VLLM_IMAGE)}")
        for i in range(4):
            result = client.images.generate(model=model, prompt=f"a cube {i}", size="64x64", response_format="b64_json")
            if not result.data or not result.data[0].b64_json:
                raise StepError("the vLLM-Omni answer has no image")
            path = self.paths.out / f"vllm-omni-{i}.png"
            path.write_bytes(base64.b64decode(result.data[0].b64_json))
        heads = [p for p in self.runner.processes("vllm-image-dit-") if "replicas" not in p.name]
        served = (
            re.findall(
                r"\[StageDiffusionClient\] stage-0 \[rep-(\d+)\] add request",
                heads[0].log_path.read_text(errors="replace"),
            )
            if heads
            else []
        )
        self.reporter.say(
            f"4 PNGs in {self.paths.out}/vllm-omni-*.png; the head's log: requests went to replica(s) "
            f"{', '.join(served[-4:])} (0 = the head pod's own, 1 = the headless replica pod)"
        )
        self.reporter.say(self.kubectl(*self._pods_args()).rstrip())

    def thinkers(self) -> list[PodProcess]:
        assert self.runner is not None
        return sorted(self.runner.processes(f"{OMNI.name}-{SCALED_STAGE}-"), key=lambda p: p.name)

    def scale(self) -> None:
        (first,) = self.thinkers()
        before = {first.name: stage_requests(first.ip)}
        doc = yaml.safe_load((REPO / "examples" / OMNI.example).read_text())
        for stage in doc["spec"]["stages"]:
            if stage["name"] == SCALED_STAGE:
                stage["replicas"] = 2
        self.reporter.say(
            f"$ kubectl apply -n {NAMESPACE} -f -   # examples/{OMNI.example} with {SCALED_STAGE}.replicas: 2"
        )
        out = self.kubectl("apply", "-n", NAMESPACE, "-f", "-", stdin=json.dumps(doc))
        self.reporter.say(out.rstrip())
        self.reporter.status = "a second thinker pod: scheduled, started here, loading"
        self.poll(
            f"{OMNI.name} Ready with 2 {SCALED_STAGE} pods",
            lambda: self.model_ready(OMNI.name) and len(self.thinkers()) == 2,
            timeout=60,
        )
        self.show(*self._pods_args(), "-l", f"omnimodel.io/stage={SCALED_STAGE}")

        def gateway_sees_both() -> bool:
            body = _health(self.gateway(OMNI)) or {}
            endpoints = ((body.get("stages") or {}).get(SCALED_STAGE) or {}).get("endpoints") or []
            healthy = [e for e in endpoints if e.get("healthy")]
            self.reporter.status = f"the gateway sees {len(healthy)} healthy {SCALED_STAGE} endpoint(s) of 2"
            return len(healthy) == 2

        self.poll(f"the gateway balancing over both {SCALED_STAGE} pods", gateway_sees_both, timeout=180)
        client = self.client(OMNI)
        model = client.models.list().data[0].id
        n = 6
        for i in range(n):
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"question {i}"}], max_tokens=4
            )
        self.reporter.say(f"sent {n} chats; requests each {SCALED_STAGE} pod served (from its own /metrics):")
        nodes = self._nodes()
        rows = []
        for p in self.thinkers():
            after = stage_requests(p.ip)
            was = before.get(p.name)
            rows.append((p, was, after))
            label = "new" if was is None else f"{was:.0f} before"
            self.reporter.say(f"  {p.name}  on {nodes.get(p.name, '?'):<8} {p.ip:<12} {after:.0f} ({label})")
        new = [after - (was or 0) for p, was, after in rows if was is None]
        if not new or new[0] <= 0:
            raise StepError(f"the new {SCALED_STAGE} pod served no request")

    def _nodes(self) -> dict[str, str]:
        pods = json.loads(self.kubectl("get", "pods", "-n", NAMESPACE, "-o", "json"))["items"]
        return {p["metadata"]["name"]: p["spec"].get("nodeName", "") for p in pods}

    # ------------------------------------------------------------------------------- keep, stop
    def keep(self) -> None:
        here = f"PYTHONPATH={REPO / 'e2e'} {sys.executable} -m omnimodel_testbed --state-dir {self.paths.state_dir}"
        self.reporter.headline(
            "Left running (--keep). The cluster lives in this demo's network namespace; from another terminal:\n"
            f"  {here} enter -- kubectl -n {NAMESPACE} get omni,pods -o wide\n"
            f"  {here} enter -- curl -s {self.gateway(OMNI)}/v1/models\n"
            f"  {here} enter      # a shell in there: KUBECONFIG is set, <svc>.<ns>.svc names resolve\n"
            + (self._vllm_omni_scaling_hint(here) if self.vllm_omni else "")
            + f"Stop it: Ctrl-C here (or kill -INT {os.getppid()}); everything is torn down."
        )
        while True:
            time.sleep(3600)

    def _vllm_omni_scaling_hint(self, here: str) -> str:
        """How to scale the vLLM-Omni image stage by hand under traffic: a client loop in one terminal, the
        replica count changed in another (docs/vllm-omni.md, "Scaling without an outage")."""
        body = '{"model":"qwen-image","prompt":"a cube","size":"64x64","response_format":"b64_json"}'
        url = f"{self.gateway(VLLM_IMAGE)}/v1/images/generations"
        loop = (
            'while :; do curl -s -o /dev/null -w "%{http_code} %{time_total}s\\n" '
            f"-H content-type:application/json -d {shlex.quote(body)} {url}; done"
        )
        patch = '[{"op":"replace","path":"/spec/stages/0/replicas","value":3}]'
        return (
            f"The vLLM-Omni image model {VLLM_IMAGE.name} runs its dit stage with 2 replicas. Traffic, then scale:\n"
            f"  {here} enter -- sh -c {shlex.quote(loop)}\n"
            f"  {here} enter -- kubectl -n {NAMESPACE} patch omnimodel {VLLM_IMAGE.name} --type json "
            f"-p {shlex.quote(patch)}   # then value 1\n"
        )

    def tear_down(self) -> None:
        with self.reporter.step("teardown", slow_after=45, look_at=self.pod_logs):
            self.teardown.close()


def _route_testbed_logs(reporter: Reporter) -> None:
    """The test bed's warnings (not its info chatter) as progress lines."""

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            reporter.say(f"[testbed] {record.getMessage()}")

    handler = Handler(level=logging.WARNING)
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    # One INFO line per HTTP request from the clients would drown the demo's own lines.
    for name in ("httpx", "httpx2", "openai"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _health(url: str) -> dict[str, Any] | None:
    with contextlib.suppress(httpx.HTTPError, ValueError):
        body: dict[str, Any] = httpx.get(f"{url}/health", timeout=3).json()
        return body
    return None


def stage_requests(ip: str, port: int = STAGE_PORT) -> float:
    """Finished requests a stage process has served, from its own ``/metrics``."""
    total = 0.0
    for line in httpx.get(f"http://{ip}:{port}/metrics", timeout=5).text.splitlines():
        if line.startswith("omnimodel_stage_requests_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def png_size(data: bytes) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk; raises StepError when ``data`` is no PNG."""
    if data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        raise StepError("the image is not a PNG file")
    width, height = struct.unpack(">II", data[16:24])
    return int(width), int(height)
