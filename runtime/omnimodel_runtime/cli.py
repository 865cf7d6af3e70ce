"""``omnimodel``: run a stage, the gateway, or everything in one process; build tiny models; benchmark.

Heavy modules (FastAPI, uvicorn, torch, engines) are imported inside the commands that need them, so
``omnimodel --help`` stays instant and a gateway process never imports torch.
"""

# Imports sit inside functions on purpose: each command pulls in only what it needs.
# ruff: noqa: PLC0415

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastapi import FastAPI

    from omnimodel_runtime.pipeline import Pipeline
    from omnimodel_runtime.settings import RuntimeSettings, ThreadPlan

log = logging.getLogger("omnimodel_runtime.cli")

# Exit codes: 2 = bad invocation or configuration (fix the flags or the pipeline file), 1 = a
# failure at run time (the engine failed to load, the port was taken).
EXIT_CONFIG = 2
EXIT_FAILED = 1
# `omnimodel fetch`: retrying cannot help (a rejected token, a missing repository, a full volume). The
# operator's fetch Job fails at once on this code (podFailurePolicy) instead of retrying.
EXIT_PERMANENT = 3


def _server_flags(p: argparse.ArgumentParser, default_port: int) -> None:
    p.add_argument("--host", default=None, help="address to bind (default 127.0.0.1, or OMNIMODEL_HOST)")
    p.add_argument("--port", type=int, default=None, help=f"port to bind (default {default_port}, or OMNIMODEL_PORT)")
    p.add_argument(
        "--log-level",
        default=None,
        choices=["critical", "error", "warning", "info", "debug"],
        help="log level (default info, or OMNIMODEL_LOG_LEVEL); debug adds tracebacks and probe access lines",
    )
    p.add_argument(
        "--log-format",
        default=None,
        choices=["text", "json"],
        help="log lines as text or one JSON object each (default text, or OMNIMODEL_LOG_FORMAT)",
    )


def _model_flags(p: argparse.ArgumentParser) -> None:
    """How ``serve`` and ``pipeline`` choose the graph, the model and the engines."""
    from omnimodel_runtime.pipeline import PRESETS

    p.add_argument("--preset", required=True, help=f"stage-graph preset: {', '.join(sorted(PRESETS))}")
    p.add_argument(
        "--model", required=True, help="model source: tiny://PRESET, file:///path, pvc://claim/path, hf://org/name"
    )
    p.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="[STAGE=]ENGINE",
        help="engine for every stage (vllm, transformers, diffusers) or for one stage; repeatable. Without it a "
        "stage whose preset engine is vllm runs on transformers (the text preset's llm)",
    )
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="engine argument for every stage (VALUE parsed as JSON when it is JSON); repeatable",
    )
    p.add_argument("--served-model-name", default=None, help="model id clients use (default: from --model)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omnimodel", description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("stage", help="serve one stage of a pipeline over the stage protocol")
    p.add_argument("--pipeline", required=True, type=Path, help="pipeline JSON file (the operator's ConfigMap)")
    p.add_argument("--stage", required=True, help="name of the stage to serve")
    _server_flags(p, 8001)

    p = sub.add_parser("gateway", help="serve the OpenAI API in front of remote stages")
    p.add_argument("--pipeline", required=True, type=Path, help="pipeline JSON file (the operator's ConfigMap)")
    _server_flags(p, 8000)

    p = sub.add_parser("serve", help="gateway and every stage in this one process")
    _model_flags(p)
    _server_flags(p, 8000)

    p = sub.add_parser(
        "pipeline",
        help="write the pipeline file of a split deployment (omnimodel stage + omnimodel gateway by hand)",
        description="Write the pipeline file that `omnimodel stage --pipeline FILE --stage NAME` and "
        "`omnimodel gateway --pipeline FILE` read: the preset bound to the model, with the URL(s) where "
        "the gateway reaches each stage. Every stage needs at least one --stage-url.",
    )
    _model_flags(p)
    p.add_argument(
        "--stage-url",
        action="append",
        default=[],
        metavar="STAGE=URL",
        help="where the gateway reaches a stage, e.g. llm=http://127.0.0.1:8001; repeat a stage for replicas",
    )
    p.add_argument(
        "--device",
        default=None,
        choices=["cpu"],
        help="cpu: every stage's accelerator becomes the CPU (default: the preset's accelerators)",
    )
    p.add_argument("--out", type=Path, default=None, help="file to write (default: standard output)")

    p = sub.add_parser("make-tiny", help="build a preset's tiny random-weight model into a directory")
    p.add_argument("--preset", required=True, help="preset whose tiny model to build (tiny://PRESET)")
    p.add_argument("--out", required=True, type=Path, help="directory to write the model into")
    p.add_argument("--seed", type=int, default=None, help="seed of the random weights (default: the preset's own)")
    p.add_argument(
        "--size",
        default=None,
        help="architecture size (default tiny; e.g. qwen2.5-1.5b for accelerator benchmarks)",
    )
    p.add_argument("--device", default=None, help="where to initialise the weights (cpu, cuda)")

    p = sub.add_parser("fetch", help="download the files an hf:// pipeline's stages need into a shared cache")
    p.add_argument("--pipeline", required=True, type=Path, help="pipeline JSON file (the operator's ConfigMap)")
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="hub cache to fill (default: huggingface_hub's, HF_HUB_CACHE or $HF_HOME/hub)",
    )
    p.add_argument("--stage", action="append", default=[], help="fetch only this stage's files; repeatable")
    p.add_argument("--progress-port", type=int, default=None, help="serve GET /progress on this port while running")
    p.add_argument("--progress-host", default=None, help="address for /progress (default 127.0.0.1, or OMNIMODEL_HOST)")
    p.add_argument(
        "--termination-log",
        type=Path,
        default=Path("/dev/termination-log"),
        help="where the one-line outcome goes (Kubernetes' termination message; default /dev/termination-log)",
    )
    p.add_argument("--log-interval", type=float, default=5.0, help="seconds between progress lines (default 5)")
    p.add_argument("--workers", type=int, default=4, help="files downloaded at once (default 4)")

    p = sub.add_parser("wait-weights", help="wait until a stage's files of an hf:// pipeline are in the cache")
    p.add_argument("--pipeline", required=True, type=Path, help="pipeline JSON file (the operator's ConfigMap)")
    p.add_argument("--cache-dir", type=Path, default=None, help="hub cache the fetch fills (default as for fetch)")
    p.add_argument("--stage", required=True, help="name of the stage whose files to wait for")
    p.add_argument("--timeout", type=float, default=None, help="give up after this many seconds (default: never)")
    p.add_argument("--interval", type=float, default=10.0, help="seconds between status lines (default 10, max 30)")

    p = sub.add_parser("demo", help="serve a tiny preset, ask it one question with the openai client, stop")
    from omnimodel_runtime.demo import add_arguments as add_demo_arguments

    add_demo_arguments(p)

    p = sub.add_parser("bench", help="benchmark a gateway against a direct engine; writes JSON")
    from omnimodel_runtime.bench import add_arguments

    add_arguments(p)
    return parser


def _settings(args: argparse.Namespace, **extra: Any) -> RuntimeSettings:
    from omnimodel_runtime.settings import RuntimeSettings

    flags = {k: getattr(args, k, None) for k in ("host", "port", "log_level", "log_format")}
    return RuntimeSettings(**{k: v for k, v in {**flags, **extra}.items() if v is not None})


def _setup_logging(level: str, fmt: str = "text") -> None:
    """Every logger of the process (uvicorn's too: run_app leaves its loggers to the root) to stderr."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        from omnimodel_runtime.web.access import JSONFormatter

        handler.setFormatter(JSONFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler])
    # httpx logs every stage request and health probe at info; the access log already says what matters.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))


def _load(path: Path) -> Pipeline:
    from omnimodel_runtime.pipeline import load_pipeline

    return load_pipeline(path)


def run_app(app: FastAPI, settings: RuntimeSettings) -> int:
    """Serve ``app`` until SIGINT/SIGTERM (graceful: in-flight requests drain for up to
    ``drain_timeout``) or until its start-up fails (exit status 1, so the pod restarts)."""
    import asyncio
    import math

    import uvicorn

    from omnimodel_runtime.web.startup import Startup

    sys.setswitchinterval(settings.gil_switch_interval)  # see RuntimeSettings.gil_switch_interval
    # Bound before anything starts, so a port in use is one line and no engine loads for nothing.
    try:
        sock = _listen(settings.host, settings.port)
    except OSError as err:
        log.error(
            "Cannot listen on %s:%d: %s (is another server running there? choose another --port)",
            settings.host,
            settings.port,
            err.strerror or err,
        )
        return EXIT_FAILED
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        # Our own logging setup (text or JSON) for uvicorn's loggers too.
        log_config=None,
        # uvicorn reads 0/None as "wait forever"; a drain of at least a second is always granted.
        timeout_graceful_shutdown=max(1, math.ceil(settings.drain_timeout)),
        lifespan="on",
        # web.access logs every request (with its id); uvicorn's own access lines would repeat them.
        access_log=False,
    )
    server = _graceful_server_class()(config)
    startup: Startup = app.state.startup
    log.info(
        "Listening on http://%s:%d; loading (GET /health answers 503 until ready, /livez 200)",
        settings.host,
        sock.getsockname()[1],
    )

    async def main() -> int:
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        failed = asyncio.create_task(startup.failed.wait())
        await asyncio.wait({serving, failed}, return_when=asyncio.FIRST_COMPLETED)
        if failed.done() and not serving.done():
            log.error("Start-up failed, exiting: %s", startup.error)
            server.should_exit = True
            await serving
            return EXIT_FAILED
        failed.cancel()
        await serving
        return 0 if server.started else EXIT_FAILED

    return asyncio.run(main())


def _listen(host: str, port: int) -> Any:
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _graceful_server_class() -> type[Any]:
    import contextlib
    import signal
    import threading
    from collections.abc import Iterator

    import uvicorn

    class GracefulServer(uvicorn.Server):
        """uvicorn re-raises a caught SIGTERM after its graceful shutdown, so even a clean drain ends
        "killed by signal"; here a drained shutdown exits 0 (and a failed one still exits non-zero)."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    return GracefulServer


def _limit_threads(settings: RuntimeSettings, pipeline: Pipeline | None = None) -> ThreadPlan:
    """Set the thread variables of this process (OpenMP, MKL, OpenBLAS, tokenizers) from the CPUs it may
    use, leaving the ones the user set (see ``RuntimeSettings.cpu_threads``). Called before torch and numpy
    load: OpenMP and OpenBLAS read them once, when loaded. ``pipeline``: a split deployment's file, whose
    loopback endpoints are stage processes sharing this host's CPUs."""
    import os

    from omnimodel_runtime.settings import cpu_budget, plan_threads, thread_env

    sharers = _stage_processes_here(pipeline) if pipeline is not None else 1
    plan = plan_threads(cpu_budget(), setting=settings.cpu_threads, environ=os.environ, sharers=sharers)
    os.environ.update(thread_env(plan.count, os.environ))
    return plan


def _stage_processes_here(pipeline: Pipeline) -> int:
    """Stage processes the pipeline file puts on this host: one per loopback endpoint (split mode on one
    host, as by hand). Elsewhere each stage has a host or pod, and CPUs, of its own."""
    import ipaddress
    from urllib.parse import urlsplit

    def loopback(url: str) -> bool:
        host = urlsplit(url).hostname or ""
        try:
            return host == "localhost" or ipaddress.ip_address(host).is_loopback
        except ValueError:  # a host name
            return False

    return len({url for stage in pipeline.stages for url in stage.endpoints if loopback(url)})


def _torch_threads(plan: ThreadPlan) -> str:
    """torch's pools sized to ``plan`` (torch imported now, if it is installed); what they are."""
    try:
        from omnimodel_runtime.engines.devices import set_torch_threads
    except ImportError:
        return "no torch"
    # Nothing the engines run uses torch's inter-op pool (torch.jit.fork); one thread is plenty.
    intra, inter = set_torch_threads(plan.count, 1)
    return f"torch intra {intra}, inter {inter}"


def _log_threads(plan: ThreadPlan, torch_part: str) -> None:
    import os

    omp = os.environ.get("OMP_NUM_THREADS", "unset")
    log.info("threads: %d (%s; %s, OMP %s)", plan.count, plan.describe(), torch_part, omp)


def cmd_stage(args: argparse.Namespace) -> int:
    settings = _settings(args, pipeline=args.pipeline, stage=args.stage)
    _setup_logging(settings.log_level, settings.log_format)
    pipeline = _load(args.pipeline)
    plan = _limit_threads(settings, pipeline)
    from omnimodel_runtime.stage.server import build_stage_app  # numpy loads here, after _limit_threads

    app = build_stage_app(settings, pipeline, args.stage)
    _log_threads(plan, _torch_threads(plan))
    return run_app(app, settings)


def cmd_gateway(args: argparse.Namespace) -> int:
    settings = _settings(args, pipeline=args.pipeline)
    _setup_logging(settings.log_level, settings.log_format)
    pipeline = _load(args.pipeline)
    plan = _limit_threads(settings, pipeline)
    from omnimodel_runtime.gateway import build_gateway_app  # numpy loads here, after _limit_threads

    app = build_gateway_app(settings, pipeline)
    _log_threads(plan, "no torch in a gateway")
    return run_app(app, settings)


def _parse_kv(items: Sequence[str], what: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{what} must look like KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def cmd_serve(args: argparse.Namespace) -> int:
    settings = _settings(args)
    _setup_logging(settings.log_level, settings.log_format)
    plan = _limit_threads(settings)
    from omnimodel_runtime.serve import build_serve_app, serve_pipeline  # numpy loads here

    pipeline = serve_pipeline(
        args.preset,
        args.model,
        engines=args.engine,
        engine_args=_parse_kv(args.engine_arg, "--engine-arg"),
        served_model_name=args.served_model_name,
        device=_local_device(settings.device),
        local_defaults=True,
    )
    _log_choices(pipeline, args.engine)
    app = build_serve_app(settings, pipeline)
    _log_threads(plan, _torch_threads(plan))
    return run_app(app, settings)


def _log_choices(pipeline: Pipeline, engines: Sequence[str]) -> None:
    from omnimodel_runtime.pipeline import get_preset

    preset = get_preset(pipeline.preset) if pipeline.preset else None
    for stage in pipeline.stages:
        note = ""
        if preset is not None and not engines:
            declared = next(s.engine for s in preset.stages if s.name == stage.name)
            if declared != stage.engine:
                note = f" (the preset's engine is {declared.value}; --engine {declared.value} to use it)"
        log.info("Stage %s: %s engine, task %s%s", stage.name, stage.engine.value, stage.task, note)


def cmd_pipeline(args: argparse.Namespace) -> int:
    from omnimodel_runtime.serve import serve_pipeline

    endpoints: dict[str, list[str]] = {}
    for item in args.stage_url:
        stage, sep, url = item.partition("=")
        if not sep or not stage or not url.startswith(("http://", "https://")):
            raise ValueError(f"--stage-url must look like STAGE=http://HOST:PORT, got {item!r}")
        endpoints.setdefault(stage, []).append(url.rstrip("/"))
    pipeline = serve_pipeline(
        args.preset,
        args.model,
        engines=args.engine,
        engine_args=_parse_kv(args.engine_arg, "--engine-arg"),
        served_model_name=args.served_model_name,
        device=args.device or "auto",
        endpoints=endpoints,
        local_defaults=True,
    )
    missing = [s.name for s in pipeline.stages if not s.endpoints]
    if missing:
        raise ValueError(
            f"every stage needs a --stage-url; missing: {', '.join(missing)} "
            f"(e.g. --stage-url {missing[0]}=http://127.0.0.1:8001)"
        )
    text = pipeline.to_json()
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.write_text(text)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _local_device(setting: str) -> str:
    if setting != "auto":
        return setting
    try:
        from omnimodel_runtime.engines.devices import resolve_device
    except ImportError:  # no torch: nothing but the CPU to run on
        return "cpu"
    return resolve_device(setting)


def cmd_make_tiny(args: argparse.Namespace) -> int:
    from omnimodel_runtime.tiny import build_tiny

    _setup_logging("info")
    options = {k: v for k, v in {"size": args.size, "device": args.device}.items() if v is not None}
    out = build_tiny(args.preset, args.out, seed=args.seed, **options)
    print(out)
    return 0


def _write_termination(path: Path, line: str) -> None:
    """The container's termination message (Kubernetes reads it; 4 KiB at most)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(line[:4000] + "\n")
    except OSError as err:
        log.warning("cannot write the termination message to %s: %s", path, err)


def cmd_fetch(args: argparse.Namespace) -> int:
    from omnimodel_runtime.fetch import FetchProgress, ProgressServer, Ticker, WeightsError, fetch_pipeline
    from omnimodel_runtime.fetch.cache import default_cache_dir

    _setup_logging("info")
    for noisy in ("httpx", "httpx2", "huggingface_hub"):  # one line per HTTP request; ours say more
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        pipeline = _load(args.pipeline)
    except Exception as err:
        _write_termination(args.termination_log, "Invalid: " + " ".join(str(err).split()))
        raise
    cache = args.cache_dir or default_cache_dir()
    progress = FetchProgress(pipeline.model.source)
    server = None
    if args.progress_port is not None:
        host = args.progress_host or _settings(args).host
        try:
            server = ProgressServer(progress, host, args.progress_port).start()
        except OSError as err:
            message = f"Invalid: cannot serve /progress on {host}:{args.progress_port}: {err}"
            _write_termination(args.termination_log, message)
            print(f"omnimodel fetch: {message}", file=sys.stderr)
            return EXIT_CONFIG
        log.info("progress on http://%s:%d/progress", host, server.port)
    try:
        with Ticker(progress, max(0.5, args.log_interval)):
            result = fetch_pipeline(pipeline, cache, stages=args.stage, progress=progress, workers=args.workers)
    except WeightsError as err:
        from omnimodel_runtime.fetch.hub import PERMANENT

        log.error("fetch failed: %s", err)
        _write_termination(args.termination_log, str(err))
        return EXIT_PERMANENT if err.reason in PERMANENT else EXIT_FAILED
    finally:
        if server is not None:
            server.stop()
    log.info("%s", progress.line())
    log.info("%s", result.message())
    _write_termination(args.termination_log, result.message())
    return 0


def cmd_wait_weights(args: argparse.Namespace) -> int:
    from omnimodel_runtime.fetch import wait_for_weights
    from omnimodel_runtime.fetch.cache import default_cache_dir

    pipeline = _load(args.pipeline)
    cache = args.cache_dir or default_cache_dir()

    def say(line: str) -> None:
        print(f"omnimodel wait-weights: {line}", flush=True)

    interval = min(30.0, max(0.5, args.interval))
    ready = wait_for_weights(pipeline, cache, args.stage, timeout=args.timeout, interval=interval, say=say)
    return 0 if ready else EXIT_FAILED


def cmd_demo(args: argparse.Namespace) -> int:
    from omnimodel_runtime.demo import run

    return run(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from omnimodel_runtime.bench import run

    _setup_logging("warning")
    return run(args)


COMMANDS = {
    "stage": cmd_stage,
    "gateway": cmd_gateway,
    "serve": cmd_serve,
    "pipeline": cmd_pipeline,
    "make-tiny": cmd_make_tiny,
    "fetch": cmd_fetch,
    "wait-weights": cmd_wait_weights,
    "demo": cmd_demo,
    "bench": cmd_bench,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``omnimodel`` console script."""
    from pydantic import ValidationError

    from omnimodel_runtime.errors import RuntimeSetupError
    from omnimodel_runtime.pipeline import PipelineError

    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (PipelineError, RuntimeSetupError, ValidationError, ValueError, FileNotFoundError) as err:
        print(f"omnimodel {args.command}: {err}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt:
        return 130
