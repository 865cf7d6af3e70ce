"""olah, the self-hosted Hugging Face mirror, serving the test bed's local repositories offline.

Run with the mirror's own environment (``e2e/hfmirror/setup-env``), not the project's::

    <env>/bin/python e2e/hfmirror/olah_server.py --root DIR --host 127.0.0.5 --port 8090

olah serves the Hub's HTTP protocol (``/api/models/...``, ``/<repo>/resolve/<revision>/<file>``, LFS)
from git repositories under ``DIR/mirrors/models/<org>/<name>``. Two things olah does not do for local
repositories are added around its ASGI app here, and nothing else:

- **tokens** (``DIR/control.json`` ``{"private": {"org/name": ["token", ...]}}``): olah passes
  ``Authorization`` upstream only, so a private repository answers as the Hub does: no token -> 401
  ``RepoNotFound``; a token the mirror does not know -> 401 "Invalid credentials in Authorization header"
  (for any repository, as the Hub does); a known token without access -> 404 ``RepoNotFound``;
- **an access log** (``DIR/access.jsonl``, one JSON object per request: method, path, status, body bytes
  sent, repo, revision, file, token = none/valid/invalid), and an optional rate limit on response bodies
  (``control.json`` ``"rate_bytes_per_s"``), so tests can watch a download in flight.

``control.json`` is re-read when it changes, and olah reads the git repositories on every request, so
repositories and tokens can change while the mirror runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import unquote

INVALID_CREDENTIALS = "Invalid credentials in Authorization header"
_API = re.compile(r"^/api/models/([^/]+)/([^/]+)(?:/|$)")
_RESOLVE = re.compile(r"^/([^/]+)/([^/]+)/resolve/([^/]+)/(.+)$")


class Control:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._mtime: float | None = None
        self._data: dict[str, Any] = {}

    def data(self) -> dict[str, Any]:
        try:
            mtime = self.path.stat().st_mtime_ns
        except OSError:
            return {}
        if mtime != self._mtime:
            try:
                self._data = json.loads(self.path.read_text())
                self._mtime = mtime
            except (OSError, ValueError):
                pass
        return self._data


class Mirror:
    """ASGI wrapper: token checks for private repositories, an access log, an optional rate limit."""

    def __init__(self, app: Any, root: Path) -> None:
        self.app = app
        self.control = Control(root / "control.json")
        self.log_path = root / "access.jsonl"
        self._lock = threading.Lock()

    def _log(self, entry: dict[str, Any]) -> None:
        line = json.dumps(entry, sort_keys=True) + "\n"
        with self._lock, self.log_path.open("a") as fh:
            fh.write(line)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        repo = revision = file = None
        if m := _RESOLVE.match(path):
            repo, revision, file = f"{m[1]}/{m[2]}", unquote(m[3]), m[4]
        elif m := _API.match(path):
            repo = f"{m[1]}/{m[2]}"
        headers = {k.decode().lower(): v.decode() for k, v in scope.get("headers", [])}
        auth = headers.get("authorization", "")
        token = auth[7:].strip() if auth.lower().startswith("bearer ") else None
        control = self.control.data()
        private: dict[str, list[str]] = control.get("private", {})
        known = {t for tokens in private.values() for t in tokens}
        token_state = "none" if token is None else ("valid" if token in known else "invalid")
        entry: dict[str, Any] = {
            "ts": time.time(),
            "method": scope["method"],
            "path": path,
            "repo": repo,
            "revision": revision,
            "file": file,
            "token": token_state,
            "bytes": 0,
        }
        refusal = None
        if token_state == "invalid" and (known or repo in private):
            refusal = (401, {"x-error-message": INVALID_CREDENTIALS}, {"error": INVALID_CREDENTIALS})
        elif repo in private and token not in private[repo]:
            status = 401 if token is None else 404
            refusal = (
                status,
                {"x-error-code": "RepoNotFound", "x-error-message": "Repository not found"},
                {"error": "Repository not found"},
            )
        if refusal is not None:
            status, extra, body = refusal
            payload = json.dumps(body).encode()
            raw = [(k.encode(), v.encode()) for k, v in extra.items()]
            raw += [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
            await send({"type": "http.response.start", "status": status, "headers": raw})
            await send({"type": "http.response.body", "body": payload if scope["method"] != "HEAD" else b""})
            entry.update(status=status, bytes=0 if scope["method"] == "HEAD" else len(payload), refused=True)
            self._log(entry)
            return
        rate = control.get("rate_bytes_per_s")

        async def counting_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                entry["status"] = message["status"]
            elif message["type"] == "http.response.body":
                body = message.get("body", b"")
                if rate and body:
                    await asyncio.sleep(len(body) / float(rate))
                entry["bytes"] += len(body)
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            self._log(entry)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--root", required=True, type=Path)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    root: Path = args.root.resolve()
    for sub in ("mirrors/models", "repos", "logs"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    config = root / "olah.toml"
    config.write_text(
        "[basic]\n"
        f'host = "{args.host}"\n'
        f"port = {args.port}\n"
        f'repos-path = "{root / "repos"}"\n'
        f'mirrors-path = ["{root / "mirrors"}"]\n'
        f'mirror-netloc = "{args.host}:{args.port}"\n'
        f'mirror-lfs-netloc = "{args.host}:{args.port}"\n'
        "metadata-cache-ttl = 0\n"
        "[accessibility]\n"
        "offline = true\n"
    )
    # olah.server configures its app from these when imported (its multi-worker path).
    os.environ["OLAH_CONFIG"] = str(config)
    os.environ["OLAH_LOG_PATH"] = str(root / "logs")
    import uvicorn
    from olah.server import app

    print(f"olah mirror of {root / 'mirrors'} on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    uvicorn.run(Mirror(app, root), host=args.host, port=args.port, log_level="warning", lifespan="on")
    return 0


if __name__ == "__main__":
    sys.exit(main())
