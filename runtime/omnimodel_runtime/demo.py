"""``omnimodel demo``: start ``omnimodel serve`` on a tiny preset, ask it one chat question with the
official ``openai`` client, print the answer, stop the server. Runs offline on a laptop CPU."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from omnimodel_runtime.errors import ExtraMissingError


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``omnimodel demo``."""
    p.add_argument("--preset", default="text", help="preset to serve with its tiny model (default text)")
    p.add_argument(
        "--engine", default="transformers", choices=["transformers", "vllm"], help="engine (default transformers)"
    )
    p.add_argument("--question", default="Hello! Who are you?", help="what to ask the model")
    p.add_argument("--max-tokens", type=int, default=32, help="longest answer in tokens (default 32)")
    p.add_argument(
        "--start-timeout", type=float, default=300.0, help="seconds to wait for the server to be ready (default 300)"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def run(args: argparse.Namespace) -> int:
    """Serve, ask, print, stop. Returns the exit status."""
    try:
        import httpx  # noqa: PLC0415  (the runtime image may lack the client)
        import openai  # noqa: PLC0415
    except ImportError as err:
        raise ExtraMissingError(what="omnimodel demo", extra="dev", cause=err) from err

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "omnimodel_runtime",
        "serve",
        "--preset",
        args.preset,
        "--model",
        f"tiny://{args.preset}",
        "--engine",
        args.engine,
        "--port",
        str(port),
    ]
    print(f"$ omnimodel serve --preset {args.preset} --model tiny://{args.preset} --engine {args.engine} --port {port}")
    with tempfile.TemporaryDirectory(prefix="omnimodel-demo-") as tmp:
        log_path = Path(tmp) / "serve.log"
        with log_path.open("wb") as log:
            server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
        try:
            deadline = time.monotonic() + args.start_timeout
            while True:
                if server.poll() is not None:
                    print(log_path.read_text(errors="replace")[-3000:], file=sys.stderr)
                    print(f"omnimodel demo: the server exited with {server.returncode}", file=sys.stderr)
                    return 1
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    print(f"omnimodel demo: {url} did not become healthy in time", file=sys.stderr)
                    return 1
                time.sleep(0.25)

            client = openai.OpenAI(base_url=f"{url}/v1", api_key="demo", max_retries=0)
            model = client.models.list().data[0].id
            print(f"user> {args.question}")
            reply = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": args.question}],
                max_tokens=args.max_tokens,
            )
            print(f"{model}> {reply.choices[0].message.content}")
            if reply.usage is not None:
                u = reply.usage
                print(f"(usage: {u.prompt_tokens} prompt + {u.completion_tokens} completion tokens; random weights)")
            return 0
        finally:
            if server.poll() is None:
                server.send_signal(signal.SIGTERM)
                try:
                    server.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    server.kill()
                    server.wait()
            print("server stopped")
