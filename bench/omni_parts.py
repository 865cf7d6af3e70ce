"""Where a Qwen2.5-Omni stream's time goes on a GPU: one decode step of the thinker and of the talker (the
engines' :class:`SlotDecoder`, as captured CUDA graphs, eager kernels vs ``compile``), and one chunked DiT
pass of code2wav (the first window, 36 codes, as the engine captures it, eager vs compiled blocks), each
timed as the median of ``--runs`` replays after warm-up, in one process, side by side.

    python bench/omni_parts.py --model /dev/shm/omni7b --out omni-parts.json

The engines' own classes and loaders, outside any server: what one step or pass costs the GPU, which the
end-to-end figures of ``omnimodel bench --mode omni`` then add up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from transformers import (
    Qwen2_5OmniTalkerForConditionalGeneration,
    Qwen2_5OmniThinkerForConditionalGeneration,
    Qwen2_5OmniToken2WavModel,
)

from omnimodel_runtime.engines.omni.code2wav_dit import TOKEN2WAV_DEFAULTS, ChunkPlan
from omnimodel_runtime.engines.omni.code2wav_graphs import _MelRunner
from omnimodel_runtime.engines.omni.common import Speakers, load_config, load_part, load_prefixed
from omnimodel_runtime.engines.slots import SlotDecoder

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke run of this script, not a figure


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed(fn: Any, runs: int) -> dict[str, Any]:
    for _ in range(3):
        fn()
    sync()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return {"median_ms": round(1000 * statistics.median(times), 3), "min_ms": round(1000 * min(times), 3)}


def decode_steps(body: Any, head: Any, runs: int, rows: int, length: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for compiled in (False, True):
        t0 = time.perf_counter()
        decoder = SlotDecoder(body, head, slots=8, capacity=1024, graphs=DEVICE == "cuda", compiled=compiled)
        decoder.capture_all()
        capture_s = time.perf_counter() - t0
        hidden = decoder._embeds.shape[1]
        embeds = torch.randn((rows, hidden), dtype=decoder.dtype, device=decoder.device)
        index = [length - 1] * rows
        key = "compiled" if decoder.compiled else "eager_kernels"  # a failed compile falls back: says so
        out[key] = timed(lambda d=decoder, e=embeds, i=index: d.step(e, i), runs) | {"start_s": round(capture_s, 1)}
        del decoder
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True  # as code2wav sets it (the thinker and talker are bf16)
    config = load_config(args.model)
    report: dict[str, Any] = {
        "meta": {
            "command": "python bench/omni_parts.py " + " ".join(f"--{k} {v}" for k, v in vars(args).items()),
            "accelerator": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
            "torch": torch.__version__,
        },
        "results": {},
    }
    results = report["results"]

    with torch.inference_mode():
        parts = (
            ("thinker", Qwen2_5OmniThinkerForConditionalGeneration, config.thinker_config, "lm_head", 300),
            ("talker", Qwen2_5OmniTalkerForConditionalGeneration, config.talker_config, "codec_head", 400),
        )
        for name, cls, sub_config, head, length in parts:  # one part in memory at a time
            part = load_part(cls, args.model, sub_config, dtype=torch.bfloat16, device=DEVICE)
            for rows in (1, 4):
                key = f"{name}_step_rows{rows}"
                results[key] = decode_steps(part.model, getattr(part, head), args.runs, rows, length)
                print(f"{name} rows {rows}", results[key], flush=True)
            del part
        model = Qwen2_5OmniToken2WavModel._from_config(config.token2wav_config)
        load_prefixed(model, args.model, "token2wav.")
        model = model.float().to(DEVICE).eval()
        speakers = Speakers.load(args.model)
        speaker = speakers[speakers.default]
        plan = ChunkPlan.from_args(config.token2wav_config.dit_config, {})
        first = plan.first + plan.lookahead
        dit = model.code2wav_dit_model
        job = SimpleNamespace(
            data={
                "cond": speaker["cond"].float().to(DEVICE).reshape(1, -1),
                "ref_mel": speaker["ref_mel"].float().to(DEVICE),
            }
        )
        window = SimpleNamespace(
            codes=torch.zeros(first, dtype=torch.long, device=DEVICE),
            noise=torch.randn((first * int(dit.repeats), int(dit.mel_dim)), device=DEVICE),
        )
        for compiled in (False, True):  # compiled second: it wraps the blocks' forward for good
            engine = SimpleNamespace(model=model, device=DEVICE, compiled=compiled, _options=dict(TOKEN2WAV_DEFAULTS))
            runner = _MelRunner(engine, max_rows=4, graphs=DEVICE == "cuda")  # type: ignore[arg-type]
            runner.shapes = {first}
            t0 = time.perf_counter()
            runner.capture_all(int(speaker["ref_mel"].shape[1]))
            capture_s = time.perf_counter() - t0
            key = "compiled" if runner._compiled is not None else "eager_kernels"
            for rows in (1, 4):
                section = results.setdefault(f"dit_first_window_{first}_codes_rows{rows}", {})
                items = [(job, window)] * rows
                section[key] = timed(lambda r=runner, i=items: r.run(i), max(5, args.runs // 5)) | {
                    "start_s": round(capture_s, 1)
                }
                print(f"dit rows {rows}", key, section[key], flush=True)
        vocoder_mel = torch.randn((1, int(dit.mel_dim), plan.first * 2 + 2 * plan.vocoder_context), device=DEVICE)
        results["vocoder_first_chunk"] = timed(lambda: model.code2wav_bigvgan_model(vocoder_mel), args.runs)
        print("vocoder", results["vocoder_first_chunk"], flush=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
