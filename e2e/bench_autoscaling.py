"""Autoscaling benchmark in the serving test bed: one load trace, autoscaled vs fixed replicas; writes JSON.

The same tiny OmniModel (``examples/text-tiny.yaml``, its stage on a fake NVIDIA node so that its pods
hold devices) is applied once with ``autoscaling`` (provider operator, the values of --max/--target/
--window) and once per --fixed replica count, one after the other; each gets the same trace (bench/traces/)
replayed with the official ``openai`` client through the gateway's Service. Every second the stage
Deployment's replicas, its ready replicas and the stage endpoints the gateway serves from are sampled.
Per run: the replica timeline, requests sent/served/failed, latency p50/p99 (overall and per phase),
replica-seconds and GPU-seconds (replica-seconds x the devices each pod requests) over the trace; then
autoscaled / fixed ratios.

Everything runs here for real (as ``make e2e-serving``): the cluster in a private network namespace, the
CRD, the operator process with its shipped settings, every pod a local process on its pod IP, on the CPU
(``OMNIMODEL_DEVICE=cpu``) whatever node it was placed on. Run it inside the namespace::

    PYTHONPATH=e2e .venv/bin/python -m omnimodel_testbed netns -- \\
        .venv/bin/python e2e/bench_autoscaling.py --out bench/results/autoscaling.json

(``make bench-autoscaling``). Ctrl-C stops the replay and tears everything down.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import re
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import openai

from omnimodel_operator.accelerators import ACCELERATORS
from omnimodel_operator.settings import OperatorSettings
from omnimodel_testbed import Cluster
from omnimodel_testbed.dns import ClusterDNS, service_addresses
from omnimodel_testbed.kubeapi import ApiError, KubeAPI
from omnimodel_testbed.kubelet import PodRunner
from omnimodel_testbed.netns import CLUSTER_DNS, NETNS_POD_CIDR
from omnimodel_testbed.pytest_plugin import ClusterHandle, session_cluster
from support import Kube, Operator, cpu_pod_runner, example, healthy, install_crd, wait_for

REPO = Path(__file__).parents[1]
DEFAULT_TRACE = REPO / "bench" / "traces" / "burst.json"
STAGE = "llm"
MODEL = "text"
#: Resource names a pod requests devices by (nvidia.com/gpu, amd.com/gpu, ...).
DEVICE_RESOURCES = frozenset(a.resource_name for a in ACCELERATORS.values() if a.resource_name)


# ====================================================================================== the trace


class TraceError(ValueError):
    """A trace file that does not say what to replay."""


@dataclass(frozen=True)
class Phase:
    """A stretch of the trace: ``concurrency`` closed-loop clients, or ``rate`` evenly spaced arrivals a second."""

    name: str
    seconds: float
    concurrency: int = 0
    rate: float | None = None

    def to_json(self) -> dict[str, Any]:
        load: dict[str, Any] = {"rate": self.rate} if self.rate is not None else {"concurrency": self.concurrency}
        return {"name": self.name, "seconds": self.seconds, **load}


@dataclass(frozen=True)
class Trace:
    phases: tuple[Phase, ...]
    description: str = ""

    @property
    def duration(self) -> float:
        return sum(p.seconds for p in self.phases)

    def bounds(self) -> list[tuple[Phase, float, float]]:
        """Each phase with its start and end second."""
        out, t = [], 0.0
        for p in self.phases:
            out.append((p, t, t + p.seconds))
            t += p.seconds
        return out

    def concurrency_at(self, t: float) -> int:
        """Closed-loop clients wanted at second ``t`` (0 outside the trace and in rate phases)."""
        for p, start, end in self.bounds():
            if start <= t < end:
                return p.concurrency
        return 0

    @property
    def max_concurrency(self) -> int:
        return max((p.concurrency for p in self.phases), default=0)

    def arrivals(self) -> list[float]:
        """Send times of the rate phases' requests: evenly spaced, so every replay is the same."""
        times: list[float] = []
        for p, start, end in self.bounds():
            if p.rate:
                n = math.floor(p.seconds * p.rate + 1e-9)
                times += [start + k / p.rate for k in range(n) if start + k / p.rate < end]
        return times

    def to_json(self) -> dict[str, Any]:
        return {
            "description": self.description,
            "duration_s": self.duration,
            "phases": [p.to_json() for p in self.phases],
        }


def parse_trace(data: Any) -> Trace:
    """A trace from its JSON: ``{"phases": [{"seconds", "concurrency" | "rate", "name"?}, ...]}``, a bare
    list of such phases, or ``{"rates": [r0, r1, ...]}``: arrivals a second, one entry per second (runs of
    one rate become one phase)."""
    description = ""
    if isinstance(data, dict):
        description = str(data.get("description", ""))
        if "rates" in data:
            rates = data["rates"]
            if not isinstance(rates, list) or not rates:
                raise TraceError("rates: a non-empty list of requests per second")
            runs: list[list[float]] = []
            for r in rates:
                if not isinstance(r, int | float) or isinstance(r, bool) or r < 0:
                    raise TraceError(f"rates: {r!r} is not a rate >= 0")
                if runs and runs[-1][0] == r:
                    runs[-1][1] += 1
                else:
                    runs.append([float(r), 1.0])
            start = 0
            phases = []
            for r, n in runs:
                phases.append(Phase(f"s{start}-{start + int(n)}", n, rate=r))
                start += int(n)
            return Trace(tuple(phases), description)
        data = data.get("phases")
    if not isinstance(data, list) or not data:
        raise TraceError('a trace is {"phases": [...]}, a list of phases, or {"rates": [...]}')
    phases = []
    for i, raw in enumerate(data):
        if not isinstance(raw, dict):
            raise TraceError(f"phase {i}: an object, not {raw!r}")
        unknown = set(raw) - {"name", "seconds", "concurrency", "rate"}
        if unknown:
            raise TraceError(f"phase {i}: unknown keys {sorted(unknown)}")
        seconds = raw.get("seconds")
        if not isinstance(seconds, int | float) or isinstance(seconds, bool) or seconds <= 0:
            raise TraceError(f"phase {i}: seconds must be > 0, not {seconds!r}")
        if ("concurrency" in raw) == ("rate" in raw):
            raise TraceError(f"phase {i}: exactly one of concurrency and rate")
        name = str(raw.get("name", f"phase{i}"))
        if "rate" in raw:
            rate = raw["rate"]
            if not isinstance(rate, int | float) or isinstance(rate, bool) or rate < 0:
                raise TraceError(f"phase {i}: rate must be >= 0, not {rate!r}")
            phases.append(Phase(name, float(seconds), rate=float(rate)))
        else:
            c = raw["concurrency"]
            if not isinstance(c, int) or isinstance(c, bool) or c < 0:
                raise TraceError(f"phase {i}: concurrency must be an integer >= 0, not {c!r}")
            phases.append(Phase(name, float(seconds), concurrency=c))
    return Trace(tuple(phases), description)


def load_trace(path: Path) -> Trace:
    return parse_trace(json.loads(path.read_text()))


# ====================================================================================== the numbers


def step_integral(points: Sequence[tuple[float, float]], end: float) -> float:
    """The integral over [0, end] of the step function through ``points`` (time, value): each value holds
    until the next sample; before the first sample, the first value holds."""
    if not points:
        return 0.0
    total = 0.0
    pts = sorted(points)
    for (t, v), (t_next, _) in zip(pts, [*pts[1:], (end, 0.0)], strict=True):
        lo, hi = max(t, 0.0), min(t_next, end)
        if hi > lo:
            total += v * (hi - lo)
    first_t, first_v = pts[0]
    if first_t > 0:
        total += first_v * min(first_t, end)
    return total


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100), linear between the closest ranks (numpy's default); None if empty."""
    if not values:
        return None
    xs = sorted(values)
    rank = (len(xs) - 1) * q / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


@dataclass(frozen=True)
class Record:
    """One request: when it was sent (seconds into the trace), how long it took, and how it ended."""

    start: float
    seconds: float
    error: str | None = None
    tokens: int = 0


def _rounded(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


def request_summary(records: Sequence[Record]) -> dict[str, Any]:
    ok = [r.seconds for r in records if r.error is None]
    errors: dict[str, int] = {}
    for r in records:
        if r.error is not None:
            errors[r.error] = errors.get(r.error, 0) + 1
    return {
        "sent": len(records),
        "served": len(ok),
        "failed": len(records) - len(ok),
        "latency_s": {
            "p50": _rounded(percentile(ok, 50)),
            "p99": _rounded(percentile(ok, 99)),
            "mean": _rounded(sum(ok) / len(ok) if ok else None),
            "max": _rounded(max(ok, default=None)),
        },
        "completion_tokens": sum(r.tokens for r in records),
        "errors": dict(sorted(errors.items(), key=lambda kv: -kv[1])[:5]),
    }


def per_phase(records: Sequence[Record], trace: Trace) -> list[dict[str, Any]]:
    """The request summary of each phase, by the second a request was sent."""
    out = []
    for p, start, end in trace.bounds():
        mine = [r for r in records if start <= r.start < end]
        s = request_summary(mine)
        out.append({**p.to_json(), "sent": s["sent"], "served": s["served"], "failed": s["failed"], **s["latency_s"]})
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


# ====================================================================================== load and sampling


class Replay:
    """Plays a trace through the gateway: closed-loop workers for concurrency phases (worker i sends
    while the phase wants more than i clients), a dispatcher for rate phases."""

    def __init__(self, base: str, trace: Trace, max_tokens: int, timeout: float) -> None:
        self.base = base
        self.trace = trace
        self.max_tokens = max_tokens
        self.timeout = timeout
        self.records: list[Record] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._t0 = 0.0

    def _client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key="bench", max_retries=0, timeout=self.timeout)

    def _send(self, client: openai.OpenAI, text: str) -> None:
        start = time.monotonic()
        error, tokens = None, 0
        try:
            reply = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=self.max_tokens
            )
            tokens = reply.usage.completion_tokens if reply.usage else 0
        except openai.OpenAIError as err:
            error = f"{type(err).__name__}: {str(err)[:200]}"
        record = Record(round(start - self._t0, 3), round(time.monotonic() - start, 4), error, tokens)
        with self._lock:
            self.records.append(record)

    def _worker(self, i: int) -> None:
        client = self._client()
        n = 0
        while not self._stop.is_set():
            t = time.monotonic() - self._t0
            if t >= self.trace.duration:
                return
            if i < self.trace.concurrency_at(t):
                n += 1
                self._send(client, f"w{i} q{n}")
            else:
                self._stop.wait(0.05)

    def _dispatch(self, pool: ThreadPoolExecutor) -> None:
        client = self._client()
        for k, at in enumerate(self.trace.arrivals()):
            if self._stop.wait(max(0.0, self._t0 + at - time.monotonic())):
                return
            pool.submit(self._send, client, f"r{k}")

    def run(self, t0: float) -> list[Record]:
        """Replay from ``t0`` (monotonic) to the trace's end; returns once every request sent has ended."""
        self._t0 = t0
        threads = [
            threading.Thread(target=self._worker, args=(i,), daemon=True) for i in range(self.trace.max_concurrency)
        ]
        with ThreadPoolExecutor(max_workers=64) as pool:
            threads.append(threading.Thread(target=self._dispatch, args=(pool,), daemon=True))
            for th in threads:
                th.start()
            try:
                for th in threads:
                    while th.is_alive():
                        th.join(timeout=0.5)
            except BaseException:
                self._stop.set()
                raise
        return sorted(self.records, key=lambda r: r.start)


def serving_endpoints(base: str, stage: str) -> int | None:
    """Healthy endpoints the gateway balances ``stage`` over (pods loaded and warm); None if it did not answer."""
    try:
        body = httpx.get(f"{base}/health", timeout=2).json()
    except (httpx.HTTPError, ValueError):
        return None
    endpoints = ((body.get("stages") or {}).get(stage) or {}).get("endpoints") or []
    return sum(1 for e in endpoints if e.get("healthy"))


@dataclass
class Sampler:
    """Every ``period`` seconds: the stage Deployment's spec and ready replicas, and the gateway's serving
    endpoints. A failed read repeats the previous value and is counted."""

    api: KubeAPI
    namespace: str
    deployment: str
    base: str
    t0: float
    period: float = 1.0
    omnimodel: str = ""
    samples: list[tuple[float, int, int, int]] = field(default_factory=list)
    #: (t, signal, desired replicas) whenever the autoscaler's last decision in status changed.
    decisions: list[tuple[float, float, int]] = field(default_factory=list)
    misses: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _sample(self) -> None:
        last = self.samples[-1] if self.samples else (0.0, 0, 0, 0)
        t = round(time.monotonic() - self.t0, 2)
        try:
            dep = self.api.get(f"/apis/apps/v1/namespaces/{self.namespace}/deployments/{self.deployment}")
            replicas = int(dep["spec"].get("replicas", 1))
            ready = int((dep.get("status") or {}).get("readyReplicas") or 0)
        except (ApiError, OSError):
            self.misses += 1
            replicas, ready = last[1], last[2]
        serving = serving_endpoints(self.base, STAGE)
        if serving is None:
            self.misses += 1
            serving = last[3]
        self.samples.append((t, replicas, ready, serving))
        if self.omnimodel:
            self._decision(t)

    def _decision(self, t: float) -> None:
        try:
            obj = self.api.get(f"/apis/omnimodel.io/v1alpha1/namespaces/{self.namespace}/omnimodels/{self.omnimodel}")
        except (ApiError, OSError):
            return
        for s in (obj.get("status") or {}).get("stages") or []:
            auto = s.get("autoscaler") if s.get("name") == STAGE else None
            if auto:
                seen = (float(auto.get("signal", 0)), int(auto.get("desiredReplicas", 0)))
                if not self.decisions or self.decisions[-1][1:] != seen:
                    self.decisions.append((t, *seen))

    def _loop(self) -> None:
        k = 0
        while True:
            self._sample()
            k += 1
            if self._stop.wait(max(0.0, self.t0 + k * self.period - time.monotonic())):
                return

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)


# ====================================================================================== one run


@dataclass(frozen=True)
class RunSpec:
    label: str
    name: str
    replicas: int | None = None
    autoscaling: dict[str, Any] | None = None

    @property
    def initial(self) -> int:
        if self.autoscaling is not None:
            return int(self.autoscaling.get("minReplicas", 1))
        return self.replicas or 0


def omnimodel(spec: RunSpec, devices: int) -> dict[str, Any]:
    """``examples/text-tiny.yaml`` renamed, its stage on an NVIDIA device, at fixed or autoscaled replicas."""
    doc = example("text-tiny.yaml")
    doc["metadata"]["name"] = spec.name
    (stage,) = doc["spec"]["stages"]
    stage["accelerator"] = {"vendor": "nvidia", "count": devices}
    if spec.autoscaling is not None:
        stage["autoscaling"] = spec.autoscaling
    else:
        stage["replicas"] = spec.replicas
    return doc


def devices_per_pod(deployment: dict[str, Any]) -> int:
    """Devices one pod of ``deployment`` requests (limits, as device plugins are asked)."""
    total = 0
    for c in deployment["spec"]["template"]["spec"]["containers"]:
        for key, value in ((c.get("resources") or {}).get("limits") or {}).items():
            if key in DEVICE_RESOURCES:
                total += int(value)
    return total


@dataclass
class Bed:
    cluster: ClusterHandle
    api: KubeAPI
    kube: Kube
    pods: PodRunner


def say(text: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def run_one(bed: Bed, spec: RunSpec, trace: Trace, args: argparse.Namespace) -> dict[str, Any]:
    kube, name = bed.kube, spec.name
    deployment = f"{name}-{STAGE}"
    base = f"http://{name}-gateway.{kube.ns}.svc:8000"
    say(f"{spec.label}: applying OmniModel {name}")
    kube.apply(omnimodel(spec, args.devices))
    try:
        kube.wait_ready(name, timeout=180)
        wait_for(lambda: healthy(base), 300, interval=0.5, what="gateway /health 200 (stage loaded and warm)")
        wait_for(
            lambda: serving_endpoints(base, STAGE) == spec.initial,
            300,
            interval=1,
            what=f"{spec.initial} serving endpoint(s)",
        )
        warm = openai.OpenAI(base_url=f"{base}/v1", api_key="bench", max_retries=0, timeout=args.timeout)
        for i in range(spec.initial):  # every replica warm: the gateway rotates ties between idle endpoints
            warm.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"warm {i}"}], max_tokens=4)
        dep = kube.get("deployment", deployment)
        devices = devices_per_pod(dep)
        say(f"{spec.label}: {spec.initial} replica(s) serving, {devices} device(s) a pod; replay {trace.duration:g}s")
        t0 = time.monotonic()
        sampler = Sampler(bed.api, kube.ns, deployment, base, t0, omnimodel=name if spec.autoscaling else "")
        sampler.start()
        try:
            records = Replay(base, trace, args.max_tokens, args.timeout).run(t0)
        finally:
            sampler.stop()
        finished = time.monotonic() - t0
        status = autoscaler_status(kube, name)
        events = scaled_events(kube, name)
    finally:
        kube.run("delete", "omnimodel", name, "--wait=false", check=False)
    # The next run starts on a machine without this one's processes.
    wait_for(lambda: not bed.pods.processes(f"{name}-"), 180, interval=1, what=f"{name}'s pod processes stopped")

    window = trace.duration
    spec_pts = [(t, float(n)) for t, n, _, _ in sampler.samples]
    ready_pts = [(t, float(r)) for t, _, r, _ in sampler.samples]
    serving_pts = [(t, float(s)) for t, _, _, s in sampler.samples]
    replica_s = step_integral(spec_pts, window)
    changes: list[list[float]] = []
    for t, n, _, _ in sampler.samples:
        if not changes or changes[-1][1] != n:
            changes.append([t, n])
    summary = request_summary(records)
    say(
        f"{spec.label}: {summary['served']}/{summary['sent']} served, p50 {summary['latency_s']['p50']}s "
        f"p99 {summary['latency_s']['p99']}s, {replica_s:.0f} replica-s; replicas {changes}"
    )
    return {
        "label": spec.label,
        "omnimodel": name,
        "replicas": spec.replicas,
        "autoscaling": spec.autoscaling,
        "requests": {k: v for k, v in summary.items() if k != "latency_s"},
        "latency_s": summary["latency_s"],
        "per_phase": per_phase(records, trace),
        "stages": {
            STAGE: {
                "deployment": deployment,
                "devices_per_replica": devices,
                "replica_seconds": round(replica_s, 1),
                "ready_replica_seconds": round(step_integral(ready_pts, window), 1),
                "serving_replica_seconds": round(step_integral(serving_pts, window), 1),
                "gpu_seconds": round(replica_s * devices, 1),
                "replica_changes": changes,
                "timeline": {
                    "columns": ["t_s", "replicas", "ready_replicas", "serving_endpoints"],
                    "samples": [list(s) for s in sampler.samples],
                    "missed_reads": sampler.misses,
                },
                "autoscaler_decisions": {
                    "columns": ["t_s", "signal", "desired_replicas"],
                    "note": "status.stages[].autoscaler when it changed (status is written after a decision "
                    "that scales, and on the operator's next pass otherwise)",
                    "samples": [list(d) for d in sampler.decisions],
                },
            }
        },
        "gpu_seconds": round(replica_s * devices, 1),
        "last_request_ended_s": round(finished, 1),
        "autoscaler_status": status,
        "scaled_events": events,
    }


def autoscaler_status(kube: Kube, name: str) -> dict[str, Any] | None:
    obj = kube.get("omnimodel", name) or {}
    for s in (obj.get("status") or {}).get("stages") or []:
        if s.get("name") == STAGE:
            auto: dict[str, Any] | None = s.get("autoscaler")
            return auto
    return None


def scaled_events(kube: Kube, name: str) -> list[dict[str, Any]]:
    items = (kube.get("events") or {}).get("items") or []
    return [
        {"time": e.get("lastTimestamp") or e.get("eventTime"), "message": e["message"]}
        for e in items
        if e.get("reason") == "Scaled" and e["involvedObject"]["name"] == name
    ]


# ====================================================================================== the bed


@contextlib.contextmanager
def serving_bed(workdir: Path) -> Iterator[Bed]:
    """Cluster, cluster DNS, CRD, the operator at its shipped settings, a namespace whose pods run here;
    everything stopped again on the way out, however it is left."""
    with contextlib.ExitStack() as stack:
        cluster = stack.enter_context(session_cluster())
        assert cluster.state is not None
        api = Cluster().api(cluster.state)
        dns = ClusterDNS(partial(service_addresses, api), *CLUSTER_DNS)
        stack.callback(dns.stop)
        install_crd(cluster)
        operator = Operator(cluster, workdir)  # shipped settings: no env overrides
        stack.callback(operator.stop)
        operator.start()
        ns = f"bench-{uuid.uuid4().hex[:6]}"
        cluster.kubectl("create", "namespace", ns)
        stack.callback(cluster.kubectl, "delete", "namespace", ns, "--wait=false", check=False)
        # The operator runs here from the venv, naming its default images: the pods run from the venv too.
        pods = cpu_pod_runner(api, ns, workdir / "pods", state=None)
        pods.start()
        stack.callback(pods.stop)
        say(f"test bed up: namespace {ns}, operator log {workdir}")
        yield Bed(cluster, api, Kube(cluster, ns), pods)


def machine() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def _shown(path: Path) -> str:
    """``path`` relative to the repository when it lies in it."""
    p = path.resolve()
    return str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(p)


def dumps(result: dict[str, Any]) -> str:
    """Indented JSON with every list of plain numbers on one line (the timelines stay readable)."""
    text = json.dumps(result, indent=2)
    return re.sub(r"\[\s+([-\d.,\s]+?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text) + "\n"


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="trace JSON (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "autoscaling.json")
    parser.add_argument("--min", type=int, default=1, help="autoscaling.minReplicas")
    parser.add_argument("--max", type=int, default=3, help="autoscaling.maxReplicas")
    parser.add_argument("--target", type=float, default=1, help="autoscaling.target (requests in flight a replica)")
    parser.add_argument("--window", type=int, default=60, help="autoscaling.scaleDownWindowSeconds")
    parser.add_argument("--fixed", default="", help="fixed replica counts to compare, comma-separated (default: --max)")
    parser.add_argument("--devices", type=int, default=1, help="GPUs a replica requests (accelerator.count)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=120.0, help="a request's client timeout in seconds")
    args = parser.parse_args(argv)
    if os.environ.get("OMNIMODEL_TESTBED_POD_CIDR") != NETNS_POD_CIDR:
        print("run it in the test bed's network namespace: python -m omnimodel_testbed netns -- python " + __file__)
        return 2
    trace = load_trace(args.trace)
    fixed = [int(x) for x in args.fixed.split(",") if x.strip()] or [args.max]
    autoscaling = {
        "provider": "operator",
        "minReplicas": args.min,
        "maxReplicas": args.max,
        "target": args.target,
        "scaleDownWindowSeconds": args.window,
    }
    specs = [RunSpec("autoscaled", "auto", autoscaling=autoscaling)]
    specs += [RunSpec(f"fixed-{n}", f"fixed-{n}", replicas=n) for n in fixed]
    operator_settings = OperatorSettings()
    result: dict[str, Any] = {
        "benchmark": "autoscaling",
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "trace": {"file": _shown(args.trace), **trace.to_json()},
        "model": {
            "example": "examples/text-tiny.yaml",
            "stage": STAGE,
            "accelerator": {"vendor": "nvidia", "count": args.devices},
            "max_tokens": args.max_tokens,
            "request": "one chat completion (non-streamed) per request, official openai client, no retries",
        },
        "settings": {
            "autoscaling": autoscaling,
            "fixed_replicas": fixed,
            "operator": {
                "autoscale_interval_s": operator_settings.autoscale_interval,
                "autoscale_scrape_timeout_s": operator_settings.autoscale_scrape_timeout,
                "overrides": "none (shipped settings)",
            },
            "sample_period_s": 1.0,
        },
        "machine": machine(),
        "notes": [
            "the fake nodes have no devices: every stage pod runs on this machine's CPU (OMNIMODEL_DEVICE=cpu) "
            "whatever node it was scheduled to; GPU-seconds are replica-seconds x the devices each pod requests",
            "replica-seconds integrate the Deployment's spec.replicas (pods that hold devices) over the trace's "
            "duration; ready_ and serving_replica_seconds integrate ready pods and the endpoints the gateway "
            "balances over (loaded and warm)",
            "every replica of a run shares the same CPU cores: latency does not improve with replicas here as it "
            "would with one device each",
        ],
        "runs": [],
    }
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        with serving_bed(Path(tempfile.mkdtemp(prefix="omnimodel-bench-autoscaling-"))) as bed:
            for spec in specs:
                result["runs"].append(run_one(bed, spec, trace, args))
    except KeyboardInterrupt:
        say("interrupted: torn down, no JSON written")
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    result["machine"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    auto, *fixed_runs = result["runs"]
    result["comparison"] = {
        f"autoscaled/{f['label']}": {
            "gpu_seconds": ratio(auto["gpu_seconds"], f["gpu_seconds"]),
            "p50": ratio(auto["latency_s"]["p50"], f["latency_s"]["p50"]),
            "p99": ratio(auto["latency_s"]["p99"], f["latency_s"]["p99"]),
            "served": ratio(auto["requests"]["served"], f["requests"]["served"]),
        }
        for f in fixed_runs
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(dumps(result))
    say(f"wrote {args.out}: {json.dumps(result['comparison'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
