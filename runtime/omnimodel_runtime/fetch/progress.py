"""A fetch's progress: one thread-safe state, served as JSON on ``GET /progress`` and logged as lines."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Final

log = logging.getLogger("omnimodel_runtime.fetch")

# Values of ``state``.
STARTING: Final = "starting"
RESOLVING: Final = "resolving"  # revision -> sha, listing the repository
DOWNLOADING: Final = "downloading"
COMPLETE: Final = "complete"
FAILED: Final = "failed"
SKIPPED: Final = "skipped"  # not an hf:// source: nothing to fetch

PROGRESS_PATH: Final = "/progress"


class FetchProgress:
    """What a fetch has done so far. ``bytes_done``/``files_done`` count files already in the cache too,
    ``bytes_downloaded`` only what this run transferred (0 for a second fetch of a complete revision)."""

    def __init__(self, source: str) -> None:
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self.source = source
        self.state = STARTING
        self.repo: str | None = None
        self.revision: str | None = None
        self.sha: str | None = None
        self.files_total = 0
        self.files_done = 0
        self.bytes_total = 0
        # Bytes of each stage's own file set, once planned (stages share files, so they add up to more).
        self.stage_bytes: dict[str, int] = {}
        self._bytes_complete = 0
        self.bytes_downloaded_complete = 0
        self.reason: str | None = None
        self.error: str | None = None
        # Bytes of the downloads in flight, measured on demand (partial files in the cache).
        self.in_flight: Callable[[], int] = lambda: 0

    def update(self, **fields: Any) -> None:
        with self._lock:
            for key, value in fields.items():
                setattr(self, key, value)

    def planned(self, files_total: int, bytes_total: int, files_present: int, bytes_present: int) -> None:
        with self._lock:
            self.files_total, self.bytes_total = files_total, bytes_total
            self.files_done, self._bytes_complete = files_present, bytes_present

    def file_done(self, size: int) -> None:
        with self._lock:
            self.files_done += 1
            self._bytes_complete += size
            self.bytes_downloaded_complete += size

    def fail(self, reason: str, message: str) -> None:
        with self._lock:
            self.state, self.reason, self.error = FAILED, reason, message

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            in_flight = self.in_flight() if self.state == DOWNLOADING else 0
            done = min(self.bytes_total, self._bytes_complete + in_flight) if self.bytes_total else self._bytes_complete
            return {
                "state": self.state,
                "source": self.source,
                "repo": self.repo,
                "revision": self.revision,
                "sha": self.sha,
                "bytes_done": done,
                "bytes_total": self.bytes_total,
                "bytes_downloaded": self.bytes_downloaded_complete + in_flight,
                "stage_bytes": dict(self.stage_bytes),
                "files_done": self.files_done,
                "files_total": self.files_total,
                "reason": self.reason,
                "error": self.error,
                "elapsed_s": round(time.monotonic() - self._started, 3),
            }

    def line(self) -> str:
        s = self.snapshot()
        pct = 100.0 * s["bytes_done"] / s["bytes_total"] if s["bytes_total"] else 100.0
        rate = s["bytes_downloaded"] / max(s["elapsed_s"], 1e-6)
        where = f"{s['repo']}@{s['revision']}" + (f" ({s['sha'][:12]})" if s["sha"] else "")
        return (
            f"fetch {where}: {s['state']}, {s['files_done']}/{s['files_total']} files, "
            f"{_size(s['bytes_done'])}/{_size(s['bytes_total'])} ({pct:.1f}%), "
            f"{_size(s['bytes_downloaded'])} downloaded at {_size(rate)}/s"
        )


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


class ProgressServer:
    """``GET /progress`` (and ``/healthz``) on a background thread, while the fetch runs."""

    def __init__(self, progress: FetchProgress, host: str, port: int) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == PROGRESS_PATH:
                    body, status = json.dumps(progress.snapshot()).encode(), 200
                elif path == "/healthz":
                    body, status = b'{"status": "ok"}', 200
                else:
                    body, status = b'{"error": "not found"}', 404
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("progress request: " + format, *args)

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="fetch-progress", daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> ProgressServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class Ticker:
    """Logs ``progress.line()`` every ``interval`` seconds until stopped."""

    def __init__(self, progress: FetchProgress, interval: float) -> None:
        self._progress = progress
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fetch-ticker", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            log.info("%s", self._progress.line())

    def __enter__(self) -> Ticker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
