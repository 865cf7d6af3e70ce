"""Where one Qwen-Image request's time goes under the engine's fastest exact options (``compile: regional``,
``cfg_batch`` as given): the prompt encoding, the denoise loop and the VAE decode timed apart, p50 of
``--runs`` after a warm-up, and the decode again with the VAE's decoder under ``torch.compile`` (pixels
compared with the eager decoder's on the same latents).

    python bench/t2i_parts.py --model /dev/shm/qwen-image --size 1024 --out parts.json
"""

from __future__ import annotations

import argparse
import contextlib
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
from omnimodel_runtime.engines.t2i.families import family_for
from omnimodel_runtime.engines.t2i.guidance import BatchedGuidance

PROMPT = "A red fox in a snowy forest at dawn, photograph"


def timed(fn: Any, runs: int) -> tuple[Any, float, float]:
    """fn's result, its first call's seconds and the p50 of ``runs`` more."""
    times = []
    out = None
    for _ in range(runs + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return out, round(times[0], 3), round(statistics.median(times[1:]), 4)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--cfg-batch", action="store_true")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    pipe = DiffusionPipeline.from_pretrained(args.model, dtype=torch.bfloat16).to("cuda")
    pipe.set_progress_bar_config(disable=True)
    stage = SimpleNamespace(engine_args={"compile": "regional"}, name="bench")
    DiffusersImageEngine._speed_up(SimpleNamespace(context=SimpleNamespace(stage=stage), stage=stage), pipe)  # type: ignore[arg-type]
    family = family_for(args.model)[0]
    size, report = args.size, {"meta": vars(args) | {"model": str(args.model), "out": str(args.out)}}

    def latents() -> torch.Tensor:
        guidance = BatchedGuidance(pipe, family.merge_guidance) if args.cfg_batch else contextlib.nullcontext()
        with guidance, torch.inference_mode():
            out: torch.Tensor = pipe(
                PROMPT,
                negative_prompt=" ",
                true_cfg_scale=4.0,
                width=size,
                height=size,
                num_inference_steps=args.steps,
                generator=torch.Generator("cpu").manual_seed(0),
                output_type="latent",
            ).images
        return out

    def encode() -> Any:
        with torch.inference_mode():
            return pipe.encode_prompt(PROMPT, device="cuda")

    packed, first_loop, loop = timed(latents, args.runs)
    _, _, enc = timed(encode, args.runs)
    unpacked = pipe._unpack_latents(packed, size, size, pipe.vae_scale_factor).to(pipe.vae.dtype)
    mean = torch.tensor(pipe.vae.config.latents_mean).view(1, -1, 1, 1, 1).to(unpacked)
    std = 1.0 / torch.tensor(pipe.vae.config.latents_std).view(1, -1, 1, 1, 1).to(unpacked)
    z = unpacked / std + mean

    def decode() -> np.ndarray:
        with torch.inference_mode():
            image = pipe.vae.decode(z, return_dict=False)[0][:, :, 0]
        return np.asarray(pipe.image_processor.postprocess(image, output_type="pil")[0]).astype(np.int16)

    eager_img, _, dec = timed(decode, args.runs)
    pipe.vae.decoder.compile(fullgraph=False, dynamic=False)
    compiled_img, first_compiled, dec_compiled = timed(decode, args.runs)
    diff = np.abs(compiled_img - eager_img)
    report["results"] = {
        f"{size}x{size}": {
            "encode_prompt_p50_s": enc,
            "encode_and_denoise_p50_s": loop,
            "encode_and_denoise_first_s": first_loop,
            "vae_decode_p50_s": dec,
            "vae_decode_compiled_p50_s": dec_compiled,
            "vae_decode_compiled_first_s": first_compiled,
            "compiled_decode_max_pixel_diff": int(diff.max()),
            "compiled_decode_mean_pixel_diff": round(float(diff.mean()), 3),
        }
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2), flush=True)


if __name__ == "__main__":
    main()
