"""The text-to-image engine's speed options on one pipeline, in one process: eager (diffusers as it is), then
the engine's ``cache`` and ``compile`` options applied by the engine's own code (``_speed_up``), each timed
on the same prompt and seed, with the pixel difference from the eager image of the same seed.

    python bench/t2i_speed.py --model /dev/shm/qwen-image --sizes 512,1024 --steps 20 --out result.json

Loads the pipeline once (a full ``omnimodel bench`` per option would load it twice more per option); the
numbers are one request's whole pipeline call (encode, denoise, decode), as images mode's ``direct``
baseline measures it. Writes the JSON after every variant, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from diffusers import DiffusionPipeline

from omnimodel_runtime.engines.t2i.diffusers import DiffusersImageEngine

PROMPT = "A red fox in a snowy forest at dawn, photograph"
NEGATIVE = " "


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, type=Path)
    p.add_argument("--sizes", default="512,1024")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--cfg", type=float, default=4.0)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--variants", default="eager,taylorseer,regional,regional+taylorseer")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", required=True, type=Path)
    args = p.parse_args()
    cuda = args.device == "cuda"

    started = time.perf_counter()
    pipe = DiffusionPipeline.from_pretrained(args.model, dtype=torch.bfloat16 if cuda else torch.float32)
    pipe = pipe.to(args.device)
    pipe.set_progress_bar_config(disable=True)
    report: dict[str, Any] = {
        "meta": {
            "command": "python bench/t2i_speed.py "
            + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
            "accelerator": torch.cuda.get_device_name() if cuda else "cpu",
            "torch": torch.__version__,
            "load_s": round(time.perf_counter() - started, 1),
            "prompt": PROMPT,
            "negative_prompt": NEGATIVE,
            "true_cfg_scale": args.cfg,
            "steps": args.steps,
            "seed": 0,
        },
        "results": {},
    }
    sizes = [int(s) for s in args.sizes.split(",")]
    reference: dict[int, np.ndarray] = {}

    def image(size: int) -> tuple[np.ndarray, float]:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = pipe(
            PROMPT,
            negative_prompt=NEGATIVE,
            true_cfg_scale=args.cfg,
            width=size,
            height=size,
            num_inference_steps=args.steps,
            generator=torch.Generator("cpu").manual_seed(0),
        ).images[0]
        if cuda:
            torch.cuda.synchronize()
        return np.asarray(out).astype(np.int16), time.perf_counter() - t0

    def measure(variant: str, section: dict[str, Any]) -> None:
        for size in sizes:
            wall = time.perf_counter()
            img, first = image(size)  # warm-up (and compilation, for compiled variants)
            times = []
            for _ in range(args.runs):
                img, took = image(size)
                times.append(took)
            row: dict[str, Any] = {
                "first_call_s": round(first, 3),
                "latency_p50_s": round(statistics.median(times), 4),
                "latencies_s": [round(t, 4) for t in times],
                "wall_s": round(time.perf_counter() - wall, 1),
            }
            if variant == "eager":
                reference[size] = img
            elif size in reference:
                diff = np.abs(img - reference[size])
                mse = max(float((diff.astype(np.float64) ** 2).mean()), 1e-12)
                row["max_pixel_diff_vs_eager"] = int(diff.max())
                row["mean_pixel_diff_vs_eager"] = round(float(diff.mean()), 3)
                row["psnr_db_vs_eager"] = round(float(10 * np.log10(255**2 / mse)), 2)
            section[f"{size}x{size}"] = row
            print(variant, size, row, flush=True)
            args.out.write_text(json.dumps(report, indent=2) + "\n")

    for variant in args.variants.split(","):
        engine_args: dict[str, Any] = {}
        if "taylorseer" in variant:
            engine_args["cache"] = "taylorseer"
        if "regional" in variant:
            engine_args["compile"] = "regional"
        section: dict[str, Any] = {"engine_args": engine_args}
        report["results"][variant] = section
        try:
            if engine_args:
                # The engine's own code for these engine_args, on this pipeline.
                stage = SimpleNamespace(engine_args=engine_args, name="bench")
                fake = SimpleNamespace(context=SimpleNamespace(stage=stage), stage=stage)
                DiffusersImageEngine._speed_up(fake, pipe)  # type: ignore[arg-type]
            measure(variant, section)
        except Exception as err:  # a variant that fails leaves the others' numbers
            section["error"] = f"{type(err).__name__}: {err}"
            print(variant, "failed:", section["error"], flush=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        if engine_args.get("cache"):
            pipe.transformer.disable_cache()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
