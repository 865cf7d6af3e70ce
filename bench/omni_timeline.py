"""Where a streamed Qwen2.5-Omni request's time goes end to end: ``omnimodel serve`` with every stage's
frames, batched steps and code2wav's DiT passes and vocoder calls timestamped inside the process, and the
client's own times (first text, first audio, end) on the same clock, for requests one at a time and then
``--concurrency`` at once.

    python bench/omni_timeline.py --model /dev/shm/omni7b --out omni-timeline.json [--switch-interval 0.005]

``omni_parts.py`` times each part alone; this shows how they add up when the three stages share one GPU
and one interpreter (the pace of each stage's frames, how long each worker loop spends per step, what the
first audio waited for). The raw events go with the summary so that other questions can be asked later.
With ``OMNI_TIMELINE_PROFILE=PREFIX`` the thinker's and the talker's prefills and the talker's decode steps
also run under cProfile (``PREFIX-<stage>.txt``, ``PREFIX-talker-decode.txt``; it slows them down).
"""

# The runtime's imports sit inside functions on purpose: the serve child patches its classes before the
# CLI imports anything else, and the parent never loads torch.
# ruff: noqa: PLC0415

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import itertools
import json
import os
import pstats
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

CHILD = "--serve-child"


# ----------------------------------------------------------------------------- in the serve process
def _instrument(path: str) -> None:
    """Wrap the engines' emit, advance, DiT pass and chunk finish so each leaves an event line."""
    from omnimodel_runtime.engines.omni import code2wav, code2wav_graphs, engine, talker, thinker
    from omnimodel_runtime.protocol.stage import TensorFrame

    out = open(path, "w", buffering=1)  # noqa: SIM115 - one line per event, for the life of the process
    lock = threading.Lock()

    def add(**event: Any) -> None:
        event["t"] = time.monotonic()
        line = json.dumps(event)
        with lock:
            out.write(line + "\n")

    emit = engine.OmniJob.emit

    def timed_emit(self: Any, frame: Any) -> None:
        kind = (
            (frame.meta.get("kind") or frame.meta.get("modality"))
            if isinstance(frame, TensorFrame)
            else type(frame).__name__
        )
        n = None
        if isinstance(frame, TensorFrame):
            n = int(next(iter(frame.tensors.values())).shape[0]) if frame.tensors else 0
        add(ev="emit", stage=self.engine.stage.name, rid=self.request.request_id, kind=kind, n=n)
        emit(self, frame)

    engine.OmniJob.emit = timed_emit  # type: ignore[method-assign]

    for cls in (thinker.OmniThinkerEngine, talker.OmniTalkerEngine, code2wav.OmniCode2WavEngine):
        advance = cls.advance

        def timed_advance(self: Any, jobs: list[Any], _advance: Any = advance) -> Any:
            t0 = time.monotonic()
            result = _advance(self, jobs)
            add(ev="advance", stage=self.stage.name, t0=t0, jobs=len(jobs), moved=bool(result[1]))
            return result

        cls.advance = timed_advance  # type: ignore[method-assign]

    # Each prefill (the thinker's and the talker's generate() of one token), timed; with
    # OMNI_TIMELINE_PROFILE=PREFIX also under cProfile (the calling thread on Python 3.11, every thread
    # while it is on from 3.12; the stats accumulate over every prefill and are written after each to
    # PREFIX-<stage>.txt, as the server is stopped by a signal).
    profile_prefix = os.environ.get("OMNI_TIMELINE_PROFILE")

    def _enable(profiler: cProfile.Profile) -> bool:
        """Python 3.12's cProfile is one tool for the whole process (it sees every thread while on): a
        call that overlaps another profiled one goes unprofiled instead of failing."""
        try:
            profiler.enable()
        except ValueError:
            return False
        return True

    for cls in (thinker.OmniThinkerEngine, talker.OmniTalkerEngine):
        prefill = cls._prefill
        profiler = cProfile.Profile() if profile_prefix else None

        def timed_prefill(self: Any, state: Any, _prefill: Any = prefill, _profiler: Any = profiler) -> Any:
            job = getattr(state, "job", state)
            t0 = time.monotonic()
            on = _profiler is not None and _enable(_profiler)
            try:
                return _prefill(self, state)
            finally:
                if on:
                    _profiler.disable()
                add(ev="prefill", stage=self.stage.name, rid=job.request.request_id, t0=t0)
                if on:  # (a profiler that never ran has no stats to print)
                    text = io.StringIO()
                    pstats.Stats(_profiler, stream=text).sort_stats("cumulative").print_stats(45)
                    Path(f"{profile_prefix}-{self.stage.name}.txt").write_text(text.getvalue())

        cls._prefill = timed_prefill  # type: ignore[method-assign,assignment]

    if profile_prefix:
        # The talker's batched decode steps too (PREFIX-talker-decode.txt, by own time: a step blocked on
        # the GPU shows as the time of the call that synchronises, .tolist()), written every 100 steps.
        decode = talker.OmniTalkerEngine._decode
        steps = cProfile.Profile()
        count = [0]  # profiled steps

        def profiled_decode(self: Any, rows: list[Any]) -> Any:
            on = _enable(steps)
            try:
                return decode(self, rows)
            finally:
                if on:
                    steps.disable()
                    count[0] += 1
                if on and count[0] % 100 == 0:
                    text = io.StringIO()
                    stats = pstats.Stats(steps, stream=text)
                    stats.sort_stats("tottime").print_stats(30)
                    stats.sort_stats("cumulative").print_stats(30)
                    head = f"{count[0]} steps profiled\n"
                    Path(f"{profile_prefix}-talker-decode.txt").write_text(head + text.getvalue())

        talker.OmniTalkerEngine._decode = profiled_decode  # type: ignore[method-assign]

    run = code2wav_graphs._MelRunner.run

    def timed_run(self: Any, items: list[Any]) -> Any:
        t0 = time.monotonic()
        mels = run(self, items)
        add(ev="dit", t0=t0, rows=len(items), length=int(items[0][1].codes.shape[0]),
            rids=[job.request.request_id for job, _ in items])  # fmt: skip
        return mels

    code2wav_graphs._MelRunner.run = timed_run  # type: ignore[method-assign]
    finish = code2wav._Chunked.finish

    def timed_finish(self: Any, window: Any, mel: Any) -> None:
        t0 = time.monotonic()
        finish(self, window, mel)
        add(ev="finish", t0=t0, rid=self.job.request.request_id, start=window.start, end=window.end)

    code2wav._Chunked.finish = timed_finish  # type: ignore[method-assign,assignment]


def child(argv: list[str]) -> int:
    events, cudnn_sdp, serve = argv[0], argv[1] == "on", argv[2:]
    if not cudnn_sdp:
        import torch

        torch.backends.cuda.enable_cudnn_sdp(False)
    _instrument(events)
    from omnimodel_runtime.cli import main

    return main(serve)


# ----------------------------------------------------------------------------- the client side
async def _request(client: Any, prompt: str) -> dict[str, Any]:
    """One streamed request through the bench's own omni client, its times on the monotonic clock the
    server's events use."""
    started = time.monotonic()
    seen: dict[str, Any] = {"start": started, "ttft": None, "ttfa": None, "text_done": None, "audio_chunks": 0}
    async for chunk in client.sse_chunks("/v1/chat/completions", client._body(prompt, True)):
        now = time.monotonic()
        for choice in chunk.get("choices", []):
            delta = choice.get("delta", {})
            if delta.get("content"):
                seen["ttft"] = seen["ttft"] or now
                seen["text_done"] = now
            if (delta.get("audio") or {}).get("data"):
                seen["ttfa"] = seen["ttfa"] or now
                seen["audio_chunks"] += 1
    seen["end"] = time.monotonic()
    return seen


async def _traffic(url: str, max_tokens: int, singles: int, concurrency: int) -> dict[str, Any]:
    from omnimodel_runtime.bench.chat import PROMPTS
    from omnimodel_runtime.bench.omni import OmniClient

    client = OmniClient(url, None, max_tokens)
    try:
        client.model = await client.model_id()
        await _request(client, PROMPTS[0])  # warm: connection, lazy work
        marks: dict[str, Any] = {"single_from": time.monotonic()}
        # One at a time, each prompt new to the server but the first (as in the bench's ladder).
        singles_seen = [await _request(client, PROMPTS[i % len(PROMPTS)]) for i in range(singles)]
        marks["concurrent_from"] = time.monotonic()
        together = await asyncio.gather(*(_request(client, PROMPTS[i % len(PROMPTS)]) for i in range(concurrency)))
        marks["concurrent_to"] = time.monotonic()
    finally:
        await client.aclose()
    return {"marks": marks, "single": singles_seen, "concurrent": list(together)}


# ----------------------------------------------------------------------------- the summary
def _med(values: list[float]) -> float | None:
    return round(1000 * statistics.median(values), 2) if values else None


def summarise(events: list[dict[str, Any]], seen: dict[str, Any]) -> dict[str, Any]:
    """Per request: when each stage's first frame left and at what pace the rest followed (ms); per stage,
    the worker's step times over the request's life."""

    def requests_in(lo: float, hi: float) -> list[str]:
        firsts: dict[str, float] = {}
        for e in events:
            if e["ev"] == "emit" and lo <= e["t"] <= hi and not e["rid"].startswith("warmup"):
                firsts.setdefault(e["rid"], e["t"])
        return sorted(firsts, key=firsts.__getitem__)

    def one(rid: str, client: dict[str, Any]) -> dict[str, Any]:
        t0 = client["start"]
        mine = [e for e in events if e.get("rid") == rid or rid in e.get("rids", ())]

        def times(stage: str, kind: str) -> list[float]:
            return [e["t"] for e in mine if e["ev"] == "emit" and e["stage"] == stage and e["kind"] == kind]

        rows, codes = times("thinker", "omni.thinker.reply"), times("talker", "omni.talker.codes")
        audio = [e["t"] for e in mine if e["ev"] == "emit" and e["stage"] == "code2wav" and e["kind"] == "audio"]
        dits = [e for e in mine if e["ev"] == "dit"]
        finishes = [e for e in mine if e["ev"] == "finish"]

        def rel(t: float | None) -> float | None:
            return None if t is None else round(t - t0, 4)

        def gaps(ts: list[float]) -> list[float]:
            return [b - a for a, b in itertools.pairwise(ts)]

        end = client["end"]
        steps: dict[str, Any] = {}
        for stage in ("thinker", "talker", "code2wav"):
            spans = [e for e in events if e["ev"] == "advance" and e["stage"] == stage and t0 <= e["t"] <= end]
            moved = [e["t"] - e["t0"] for e in spans if e["moved"]]
            steps[stage] = {
                "steps": len(moved),
                "step_ms_p50": _med(moved),
                "busy_fraction": round(sum(moved) / (end - t0), 3) if end > t0 else None,
            }
        prefills = {e["stage"]: round(1000 * (e["t"] - e["t0"]), 1) for e in mine if e["ev"] == "prefill"}
        return {
            "client": {k: rel(client[k]) for k in ("ttft", "ttfa", "text_done", "end")},
            "prefill_ms": prefills,
            "thinker_rows": {"n": len(rows), "first": rel(rows[0] if rows else None), "gap_ms_p50": _med(gaps(rows))},
            "talker_codes": {
                "n": len(codes),
                "first": rel(codes[0] if codes else None),
                "36th": rel(codes[35] if len(codes) > 35 else None),
                "gap_ms_p50_first48": _med(gaps(codes[:48])),
                "gap_ms_p50_after48": _med(gaps(codes[48:])),
                "last": rel(codes[-1] if codes else None),
            },
            "code2wav": {
                "first_audio_emit": rel(audio[0] if audio else None),
                "audio_emits": len(audio),
                "dit_passes": [
                    {
                        "at": rel(e["t0"]),
                        "ms": round(1000 * (e["t"] - e["t0"]), 2),
                        "rows": e["rows"],
                        "codes": e["length"],
                    }
                    for e in dits
                ],
                "finish_ms": [round(1000 * (e["t"] - e["t0"]), 2) for e in finishes],
            },
            "worker_steps": steps,
        }

    marks = seen["marks"]
    out: dict[str, Any] = {}
    for label, lo, hi, clients in (
        ("single", marks["single_from"], marks["concurrent_from"], seen["single"]),
        ("concurrent", marks["concurrent_from"], marks["concurrent_to"], seen["concurrent"]),
    ):
        rids = requests_in(lo, hi)
        # The stages' request ids are the gateway's; requests are matched to clients by arrival order.
        ordered = sorted(clients, key=lambda c: c["start"])
        out[label] = [one(rid, c) for rid, c in zip(rids, ordered, strict=False)]
    return out


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == CHILD:
        return child(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--singles", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--switch-interval", type=float, help="the server's gil_switch_interval (default: its own)")
    parser.add_argument("--cudnn-sdp", choices=("on", "off"), default="on", help="cuDNN attention in the server")
    parser.add_argument("--engine-arg", action="append", default=[])
    parser.add_argument("--start-timeout", type=float, default=600)
    args = parser.parse_args()
    from omnimodel_runtime.bench.common import free_port, wait_healthy

    port = free_port()
    events_path = args.out.with_suffix(".events.jsonl")
    serve = ["serve", "--preset", "qwen2.5-omni", "--model", f"file://{args.model}", "--port", str(port)]
    for item in args.engine_arg:
        serve += ["--engine-arg", item]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log_path = args.out.with_suffix(".log")
    env = {**os.environ, "OMNIMODEL_LOG_LEVEL": "info"}
    if args.switch_interval is not None:
        env["OMNIMODEL_GIL_SWITCH_INTERVAL"] = str(args.switch_interval)
    started = time.monotonic()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, __file__, CHILD, str(events_path), args.cudnn_sdp, *serve],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, [proc], args.out.parent, args.start_timeout)
            ready_s = time.monotonic() - started
            seen = asyncio.run(_traffic(url, args.max_tokens, args.singles, args.concurrency))
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    events = [json.loads(line) for line in events_path.read_text().splitlines() if line.strip()]
    result = {
        "meta": {"command": " ".join(sys.argv), "ready_s": round(ready_s, 1)},
        "results": summarise(events, seen),
        "client": seen,
    }
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["results"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
