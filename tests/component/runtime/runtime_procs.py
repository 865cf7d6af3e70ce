"""Helpers for runtime component tests: runtime processes on loopback ports, polled with deadlines, and an
app served over real TCP in the test's own event loop.

A plain module (not conftest) so test files can import it by its unique name.
"""

from __future__ import annotations

import asyncio
import base64
import io
import os
import signal
import socket
import subprocess
import sys
import time
import wave
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any, TypeVar

import httpx
import uvicorn
from fastapi import FastAPI

T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_for(predicate: Callable[[], T | None], *, timeout: float, what: str, interval: float = 0.05) -> T:
    """Poll ``predicate`` until it returns something truthy; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


class RuntimeProcess:
    """One ``python -m omnimodel_runtime ...`` process, logging to a file, stopped by its PID."""

    def __init__(self, name: str, args: list[str], *, log_dir: Path, env: Mapping[str, str], port: int) -> None:
        self.name = name
        self.args = args
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_dir / f"{name}-{port}.log"
        self._env = dict(env)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> RuntimeProcess:
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "omnimodel_runtime", *self.args, "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self._env,
        )
        log.close()
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path.exists() else ""

    def get(self, path: str, timeout: float = 2.0) -> httpx.Response | None:
        try:
            return httpx.get(f"{self.url}{path}", timeout=timeout)
        except httpx.HTTPError:
            return None

    def wait_healthy(self, timeout: float = 120.0) -> RuntimeProcess:
        def ready() -> bool:
            if not self.alive:
                raise AssertionError(f"{self.name} exited with {self.returncode}:\n{self.log_tail()}")
            resp = self.get("/health")
            return resp is not None and resp.status_code == 200

        wait_for(ready, timeout=timeout, what=f"{self.name} /health to turn 200")
        return self

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL: the process dies with no chance to clean up (a crashed pod)."""
        if self.alive:
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL if it does not exit within ``timeout``."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode


@contextmanager
def running(*procs: RuntimeProcess) -> Iterator[tuple[RuntimeProcess, ...]]:
    """Start ``procs`` and stop every one of them on the way out, whatever happens."""
    try:
        for p in procs:
            p.start()
        yield procs
    finally:
        for p in procs:
            p.stop()


def metric_value(text: str, name: str, labels: Mapping[str, str] | None = None) -> float | None:
    """One sample from a Prometheus text exposition (``None`` when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in (labels or {}).items()):
                return float(sample.value)
    return None


def runtime_env(model_cache: Path, **extra: Any) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNIMODEL_")}
    env.update({"OMNIMODEL_MODEL_CACHE": str(model_cache), "OMNIMODEL_LOG_LEVEL": "info"})
    env.update({k: str(v) for k, v in extra.items()})
    return env


@asynccontextmanager
async def served_over_tcp(app: FastAPI) -> AsyncIterator[str]:
    """``app`` (its lifespan already running) behind a real uvicorn server on a loopback port, in this event
    loop; yields its URL. httpx's ASGI transport buffers whole responses and never disconnects, which
    would hide what a real client does to a stream."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            assert not task.done(), "the server failed to start"
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


def wav_of(message: Mapping[str, Any]) -> bytes:
    """The WAV file of a chat answer's ``message.audio`` (checked: 24 kHz, mono, 16-bit, not empty)."""
    data = base64.b64decode(message["audio"]["data"])
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
        assert w.getnframes() > 0
    return data


def stage_requests(metrics: str, stage: str) -> float:
    """Finished requests of ``stage`` (any outcome) in a Prometheus exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(
        s.value
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
        if s.name == "omnimodel_stage_requests_total" and s.labels.get("stage") == stage
    )
