"""``omnimodel bench``: latency, TTFT and throughput through gateway + stage, against the engine called
directly on the same prompts in the same run; one module per mode (``chat``, ``speech``, ``omni``,
``images``), what they share in ``common``.

Without ``--url`` it deploys the preset itself as separate processes (``omnimodel stage`` and
``omnimodel gateway`` from one pipeline file, on loopback ports), so every measured request crosses both
HTTP hops exactly as in a cluster. The direct baseline loads the same engine in this process. Overhead
is measured sequentially and interleaved (direct, gateway, direct, ...) so both see the same machine
state; throughput is measured at concurrency N and at 1 through the gateway, and the same for the
direct engine (its ratio is the engine's batching factor).
"""

# Imports sit inside functions on purpose: each mode pulls in only what it needs.
# ruff: noqa: PLC0415

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from omnimodel_runtime.bench import chat as chat_mode
from omnimodel_runtime.bench import images as images_mode
from omnimodel_runtime.bench import omni as omni_mode
from omnimodel_runtime.bench import speech as speech_mode
from omnimodel_runtime.bench.common import deployment, serve_process


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``omnimodel bench`` (kept here so the CLI module stays small)."""
    p.add_argument("--url", default=None, help="gateway to drive (default: deploy stage + gateway locally)")
    p.add_argument("--preset", default="text", help="preset to deploy when no --url is given (default text)")
    p.add_argument("--model", default="tiny://text", help="model source to deploy (default tiny://text)")
    p.add_argument(
        "--engine",
        default="transformers",
        choices=["transformers", "vllm", "diffusers"],
        help="engine of the deployed stage (default transformers)",
    )
    p.add_argument("--concurrency", type=int, default=8, help="concurrent clients (default 8)")
    p.add_argument("--requests", type=int, default=32, help="requests per concurrency run")
    p.add_argument("--rounds", type=int, default=3, help="sequential interleaved rounds over the prompts")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per answer (default 64)")
    p.add_argument("--api-key", default=None, help="API key of the gateway at --url")
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="engine argument for every deployed stage (VALUE parsed as JSON when it is JSON); repeatable",
    )
    p.add_argument("--no-direct", action="store_true", help="skip the in-process engine baseline")
    p.add_argument("--out", type=Path, default=None, help="write the JSON here (default: stdout only)")
    p.add_argument(
        "--start-timeout", type=float, default=300.0, help="seconds to wait for a deployment to be ready (default 300)"
    )
    p.add_argument(
        "--mode",
        default="auto",
        choices=["auto", "chat", "speech", "omni", "images"],
        help=(
            "what to measure (auto: images for presets serving /v1/images/generations, speech for presets "
            "serving /v1/audio/speech only, omni for chat presets with audio output, else chat)"
        ),
    )
    omni = p.add_argument_group("omni mode")
    omni.add_argument(
        "--omni-concurrency",
        type=lambda v: sorted({int(c) for c in v.split(",")}),
        default=[1, 4, 16, 64],
        help="comma-separated concurrency levels of streamed requests (default 1,4,16,64)",
    )
    omni.add_argument(
        "--omni-requests", type=int, default=8, help="streamed requests per concurrency level (at least the level)"
    )
    omni.add_argument("--omni-prompts", type=int, default=8, help="prompts per sequential round (at most 8)")
    omni.add_argument(
        "--omni-deployments",
        default="in_process,three_processes",
        help="which deployments to measure: in_process (omnimodel serve), three_processes (gateway + stages)",
    )
    omni.add_argument(
        "--hf-baseline",
        type=int,
        default=2,
        help=(
            "Hugging Face whole-model requests after a warm-up, in a process of its own once the deployments "
            "have stopped (0: skip)"
        ),
    )
    images = p.add_argument_group("images mode")
    images.add_argument("--size", default="512x512", help="image size WIDTHxHEIGHT")
    images.add_argument("--steps", type=int, default=20, help="denoising steps")
    images.add_argument("--negative-prompt", default=None, help="turns classifier-free guidance on")
    images.add_argument("--true-cfg-scale", type=float, default=4.0, help="guidance scale with --negative-prompt")
    images.add_argument(
        "--image-concurrency",
        type=lambda v: sorted({int(c) for c in v.split(",")}),
        default=[1, 4, 8],
        help="comma-separated concurrency levels (default 1,4,8)",
    )
    images.add_argument(
        "--image-requests", type=int, default=8, help="requests per concurrency level (at least 2 per client)"
    )
    images.add_argument("--overhead-prompts", type=int, default=4, help="prompts per overhead round")


def engine_args(args: argparse.Namespace) -> dict[str, Any]:
    """``--engine-arg KEY=VALUE`` items as ``omnimodel serve`` reads them."""
    out: dict[str, Any] = {}
    for item in getattr(args, "engine_arg", None) or ():
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--engine-arg must look like KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def _accelerator_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args``; print the JSON and write it to ``--out``."""
    from importlib.metadata import version

    meta: dict[str, Any] = {
        "command": "omnimodel bench " + " ".join(sys.argv[2:]) if len(sys.argv) > 1 else "omnimodel bench",
        "preset": args.preset,
        "model": args.model,
        "engine": args.engine,
        "engine_args": engine_args(args),
        "max_tokens": args.max_tokens,
        "concurrency": args.concurrency,
        "requests": args.requests,
        "rounds": args.rounds,
        "topology": "external gateway" if args.url else "gateway process -> stage process (loopback HTTP)",
        "host": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": version("torch"),
            "accelerator": _accelerator_name(),
            "platform": platform.platform(),
        },
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    images = images_mode.selected(args)
    speech = not images and speech_mode.selected(args)
    omni = not images and omni_mode.selected(args)
    if images:
        width, height = images_mode.image_size(args)
        for key in ("max_tokens", "concurrency", "requests"):
            meta.pop(key)
        meta.update(
            mode="images",
            engine="diffusers",
            size=f"{width}x{height}",
            steps=args.steps,
            negative_prompt=args.negative_prompt,
            true_cfg_scale=args.true_cfg_scale if args.negative_prompt is not None else None,
            image_concurrency=args.image_concurrency,
            image_requests=args.image_requests,
            topology="gateway process -> one process per stage (loopback HTTP)",
        )
    if omni:
        meta.update(mode="omni", topology="omnimodel serve (one process) vs gateway + one process per stage")
    if speech:
        meta.update(mode="speech", topology="gateway process -> one process per stage (loopback HTTP)")
        meta.pop("max_tokens")
    with tempfile.TemporaryDirectory(prefix="omnimodel-bench-") as tmp, contextlib.ExitStack() as stack:
        if images:
            args.engine = "diffusers"
            url = args.url or stack.enter_context(deployment(args, Path(tmp)))
            results = asyncio.run(images_mode.measure(args, url))
        elif omni:
            # Both deployments side by side in one run, measured interleaved on the same prompts.
            wanted = {name.strip() for name in args.omni_deployments.split(",") if name.strip()}
            urls = {}
            # Where each deployment's stage metrics are: serve's own /metrics has every stage's.
            scrape: dict[str, list[str]] = {}
            if "in_process" in wanted:
                urls["in_process"] = stack.enter_context(serve_process(args, Path(tmp)))
                scrape["in_process"] = [urls["in_process"]]
            if "three_processes" in wanted:
                scrape["three_processes"] = []
                urls["three_processes"] = stack.enter_context(
                    deployment(args, Path(tmp), stage_urls=scrape["three_processes"])
                )
            if not urls:
                raise SystemExit("--omni-deployments names none of in_process, three_processes")
            meta.update(
                omni_deployments=sorted(urls),
                omni_concurrency=args.omni_concurrency,
                omni_requests=args.omni_requests,
                hf_baseline=args.hf_baseline,
            )
            results = asyncio.run(omni_mode.measure(args, urls, scrape))
        elif speech:
            url = args.url or stack.enter_context(deployment(args, Path(tmp)))
            results = asyncio.run(speech_mode.measure(args, url))
        else:
            url = args.url or stack.enter_context(deployment(args, Path(tmp), single_stage=True))
            results = asyncio.run(chat_mode.measure(args, url))
        if omni and args.hf_baseline > 0:
            # Its own process, after the deployments above have stopped: beside them the whole model does
            # not fit an 80 GB accelerator at 7B sizes.
            stack.close()
            from omnimodel_runtime.bench.omni_hf import run_baseline

            try:
                results["hf_whole_model"] = run_baseline(args, Path(tmp))
                results["vs_hf_whole_model"] = omni_mode.versus_hf(results)
            except Exception as err:
                results.setdefault("errors", {})["hf_whole_model"] = f"{type(err).__name__}: {err}"
    report = {"meta": meta, "results": results}
    text = json.dumps(report, indent=2) + "\n"
    print(text, end="")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0
