"""Split mode by hand on one host against ``omnimodel serve``, under background CPU load: a Qwen2.5-Omni chat
with an audio question and a spoken answer, sent to each deployment in turn (alternating, the order
rotated every round), for one or more source trees of the runtime (before and after a change).

    python bench/split_threads.py --tree before=/tmp/base/runtime --tree after=runtime \\
        --out bench/results/split-threads-tiny-cpu.json

Each tree runs ``omnimodel serve`` and README's split commands (``omnimodel pipeline`` with three loopback
``--stage-url``\\ s, three ``omnimodel stage`` and an ``omnimodel gateway``) from a shell without any thread
variable (``OMP_NUM_THREADS`` and the like), as a user would. ``--load`` busy processes run throughout.
``--concurrency`` requests go to a deployment at once in each round. Reported per deployment: every
latency, their median, the median over rounds of the round's median over that of the same tree's
``serve``, each process's start-up ``threads:`` line and its thread count (``/proc``) at the end.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import math
import os
import platform
import re
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import wave
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from omnimodel_runtime.settings import THREAD_ENV  # left out of every process's environment: a user's shell

STAGES = ("thinker", "talker", "code2wav")
BUSY = "while True: pass"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def threads(self) -> int | None:
        try:
            status = Path(f"/proc/{self.popen.pid}/status").read_text()
        except OSError:
            return None
        found = re.search(r"^Threads:\s+(\d+)", status, re.MULTILINE)
        return int(found.group(1)) if found else None

    def threads_line(self) -> str | None:
        found = re.search(r"threads: .*", self.log.read_text(errors="replace"))
        return found.group(0) if found else None

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=10)


@dataclass
class Deployment:
    label: str  # "<tree>/serve" or "<tree>/split"
    url: str
    procs: list[Proc] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    round_p50: list[float] = field(default_factory=list)  # each round's median (its --concurrency requests)
    audio_s: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


def runtime(tree: Path, env: dict[str, str], workdir: Path, name: str, *args: str) -> Proc:
    log = workdir / f"{name}.log"
    with log.open("ab") as out:
        popen = subprocess.Popen(
            [sys.executable, "-m", "omnimodel_runtime", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**env, "PYTHONPATH": str(tree.resolve())},
        )
    return Proc(name, popen, log)


def start(label: str, tree: Path, env: dict[str, str], workdir: Path, model: str) -> Deployment:
    workdir.mkdir(parents=True, exist_ok=True)
    if label.endswith("/serve"):
        port = free_port()
        args = ("serve", "--preset", "qwen2.5-omni", "--model", model, "--port", str(port))
        serve = runtime(tree, env, workdir, "serve", *args)
        return Deployment(label, f"http://127.0.0.1:{port}", [serve])
    ports = {stage: free_port() for stage in STAGES}
    pipeline = workdir / "pipeline.json"
    urls = [f"--stage-url={stage}=http://127.0.0.1:{port}" for stage, port in ports.items()]
    command = ["pipeline", "--preset", "qwen2.5-omni", "--model", model, *urls, "--out", str(pipeline)]
    tree_env = {**env, "PYTHONPATH": str(tree.resolve())}
    subprocess.run([sys.executable, "-m", "omnimodel_runtime", *command], env=tree_env, check=True, capture_output=True)
    procs = [
        runtime(tree, env, workdir, stage, "stage", "--pipeline", str(pipeline), "--stage", stage, "--port", str(port))
        for stage, port in ports.items()
    ]
    gateway_port = free_port()
    gateway_args = ("gateway", "--pipeline", str(pipeline), "--port", str(gateway_port))
    gateway = runtime(tree, env, workdir, "gateway", *gateway_args)
    return Deployment(label, f"http://127.0.0.1:{gateway_port}", [*procs, gateway])


def wait_healthy(deployment: Deployment, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in deployment.procs:
            if proc.popen.poll() is not None:
                raise RuntimeError(f"{deployment.label} {proc.name} exited:\n{proc.log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{deployment.url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{deployment.label} not healthy after {timeout:.0f} s")


def question_wav(seconds: float = 1.0, rate: int = 16000) -> str:
    """A rising tone as a base64 WAV: the spoken question."""
    frames = b"".join(
        struct.pack("<h", int(8000 * math.sin(2 * math.pi * (220 + 220 * i / (seconds * rate)) * i / rate)))
        for i in range(int(seconds * rate))
    )
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(frames)
    return base64.b64encode(buffer.getvalue()).decode()


def chat(deployment: Deployment, body: dict[str, Any], timeout: float) -> None:
    started = time.perf_counter()
    try:
        resp = httpx.post(f"{deployment.url}/v1/chat/completions", json=body, timeout=timeout)
        resp.raise_for_status()
        audio = base64.b64decode(resp.json()["choices"][0]["message"]["audio"]["data"])
    except (httpx.HTTPError, KeyError, TypeError) as err:
        deployment.failures.append(f"{type(err).__name__}: {err}")
        return
    deployment.latencies.append(round(time.perf_counter() - started, 3))
    with wave.open(io.BytesIO(audio)) as w:
        deployment.audio_s.append(round(w.getnframes() / w.getframerate(), 3))


def summary(deployment: Deployment, serve: Deployment | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "url": deployment.url,
        "latencies_s": deployment.latencies,
        "latency_p50_s": round(statistics.median(deployment.latencies), 3) if deployment.latencies else None,
        "audio_s": sorted(set(deployment.audio_s)),
        "failures": deployment.failures,
        "processes": {
            p.name: {"threads_line": p.threads_line(), "threads_at_end": p.threads()} for p in deployment.procs
        },
    }
    if serve is not None and serve is not deployment:
        ratios = [a / b for a, b in zip(deployment.round_p50, serve.round_p50, strict=False)]
        out["ratio_to_serve_p50"] = round(statistics.median(ratios), 2) if ratios else None
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--tree", action="append", default=[], metavar="LABEL=PATH", help="runtime source dir")
    parser.add_argument("--model", default="tiny://qwen2.5-omni")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=1, help="requests at once per deployment and round")
    parser.add_argument("--load", type=int, default=2, help="busy background processes (default 2)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=300.0, help="per request (s)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    trees = dict(item.split("=", 1) for item in args.tree) or {"this": "runtime"}

    env = {k: v for k, v in os.environ.items() if k not in THREAD_ENV and not k.startswith("OMNIMODEL_")}
    cache = Path(tempfile.gettempdir()) / "omnimodel-split-threads-cache"
    env.update({"OMNIMODEL_MODEL_CACHE": str(cache), "OMNIMODEL_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"})
    # Built once, before any deployment: four processes would otherwise race to build it.
    build = (
        "import pathlib, sys; from omnimodel_runtime.tiny import ensure_tiny; "
        "ensure_tiny(sys.argv[1], pathlib.Path(sys.argv[2]))"
    )
    subprocess.run(
        [sys.executable, "-c", build, "qwen2.5-omni", str(cache)],
        env=env,
        check=True,
    )
    body = {
        "model": "qwen2.5-omni",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "input_audio", "input_audio": {"data": question_wav(), "format": "wav"}},
                    {"type": "text", "text": "Answer what you heard."},
                ],
            }
        ],
        "modalities": ["text", "audio"],
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "seed": 0,
    }
    workdir = Path(tempfile.mkdtemp(prefix="split-threads-"))
    deployments: list[Deployment] = []
    with ExitStack() as stack:
        for tree_label, tree in trees.items():
            for kind in ("serve", "split"):
                label = f"{tree_label}/{kind}"
                deployment = start(label, Path(tree), env, workdir / label.replace("/", "-"), args.model)
                deployments.append(deployment)
                for proc in deployment.procs:
                    stack.callback(proc.stop)
        for deployment in deployments:
            wait_healthy(deployment, timeout=600)
            chat(deployment, body, args.timeout)  # warm-up, not counted
            deployment.latencies.clear()
            deployment.audio_s.clear()
        load = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(args.load)]
        for busy in load:
            stack.callback(busy.wait)
            stack.callback(busy.kill)
        started = time.time()
        for r in range(args.rounds):
            shift = r % len(deployments)
            for deployment in deployments[shift:] + deployments[:shift]:
                done = len(deployment.latencies)
                with ThreadPoolExecutor(args.concurrency) as pool:
                    for _ in range(args.concurrency):
                        pool.submit(chat, deployment, body, args.timeout)
                these = deployment.latencies[done:]
                if these:
                    deployment.round_p50.append(statistics.median(these))
                print(f"round {r} {deployment.label}: {these}", file=sys.stderr, flush=True)
        wall = time.time() - started
        by_label = {d.label: d for d in deployments}
        results = {d.label: summary(d, by_label.get(d.label.rsplit("/", 1)[0] + "/serve")) for d in deployments}
    out = {
        "meta": {
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "trees": trees,
            "model": args.model,
            "request": "chat, 1 s input_audio + text, modalities text+audio, non-streamed, greedy, ignore_eos",
            "max_tokens": args.max_tokens,
            "rounds": args.rounds,
            "concurrency": args.concurrency,
            "background_load_processes": args.load,
            "wall_s": round(wall, 1),
            "host": {
                "cpus": os.cpu_count(),
                "affinity": len(os.sched_getaffinity(0)),
                "loadavg_at_end": os.getloadavg(),
                "python": platform.python_version(),
                "platform": platform.platform(),
            },
        },
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: (v["latency_p50_s"], v.get("ratio_to_serve_p50")) for k, v in results.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
