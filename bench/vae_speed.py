"""Qwen-Image's VAE alone at its real size (random weights): one image's decode and encode with diffusers'
causal 3D convolutions (``conv3d``) and under the engine's ``vae_2d`` (engines/t2i/vae.py), in alternating
runs so that drift hits both alike, p50 of ``--runs`` after a warm-up each, and the difference between the
two: the decoded images' pixels (as the pipeline quantises them) and the encoded latents.

Needs no pipeline: the VAE has 127 M parameters (1 s to build in bf16 on 2 CPU cores), not the whole
pipeline (a 20 B-parameter transformer and a 7 B text encoder), so a GPU session with little time left can
still measure it.

    python bench/vae_speed.py --sizes 512,1024 --runs 7 --out bench/results/vae-qwen-image-h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKLQwenImage

from omnimodel_runtime.engines.t2i.vae import undo_vae_2d, vae_2d

VARIANTS = ("conv3d", "vae2d")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="512,1024")
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", required=True, type=Path)
    args = p.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    torch.manual_seed(0)
    with torch.device(device):
        vae = AutoencoderKLQwenImage().to(dtype).eval()  # diffusers' defaults: Qwen-Image's released VAE

    def decode(latents: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = vae.decode(latents).sample
        return out

    def encode(image: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = vae.encode(image).latent_dist.mode()
        return out

    report: dict[str, Any] = {
        "meta": {
            "command": "python bench/vae_speed.py "
            + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
            "accelerator": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "parameters": sum(p.numel() for p in vae.parameters()),
        },
        "results": {},
    }
    for size in (int(s) for s in args.sizes.split(",")):
        gen = torch.Generator(device).manual_seed(size)
        side = size // vae.spatial_compression_ratio
        latents = torch.randn((1, vae.config.z_dim, 1, side, side), generator=gen, device=device, dtype=dtype)
        image = torch.rand((1, 3, 1, size, size), generator=gen, device=device, dtype=dtype) * 2 - 1
        calls: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]] = {
            "decode": (decode, latents),
            "encode": (encode, image),
        }
        times: dict[str, dict[str, list[float]]] = {part: {v: [] for v in VARIANTS} for part in calls}
        outputs: dict[str, dict[str, torch.Tensor]] = {part: {} for part in calls}
        with torch.inference_mode():
            for _ in range(args.runs + 1):  # the first round warms up (cuDNN picks its algorithms)
                for variant in VARIANTS:
                    (vae_2d if variant == "vae2d" else undo_vae_2d)(vae)
                    for part, (call, given) in calls.items():
                        sync()
                        t0 = time.perf_counter()
                        outputs[part][variant] = call(given)
                        sync()
                        times[part][variant].append(time.perf_counter() - t0)
        undo_vae_2d(vae)
        # As the pipeline's image processor quantises: (x / 2 + 0.5) clamped to [0, 1], times 255, rounded.
        pixels = {v: ((out.float() / 2 + 0.5).clamp(0, 1) * 255).round() for v, out in outputs["decode"].items()}
        diff = (pixels["vae2d"] - pixels["conv3d"]).abs()
        row: dict[str, Any] = {}
        for part, by_variant in times.items():
            p50 = {v: statistics.median(ts[1:]) for v, ts in by_variant.items()}
            row[f"{part}_p50_s"] = {v: round(t, 4) for v, t in p50.items()}
            row[f"{part}_first_s"] = {v: round(ts[0], 4) for v, ts in by_variant.items()}
            row[f"{part}_ratio_vae2d_to_conv3d"] = round(p50["vae2d"] / p50["conv3d"], 3)
        row |= {
            "max_pixel_diff": int(diff.max()),
            "mean_pixel_diff": round(float(diff.mean()), 4),
            "encode_max_abs_diff": float((outputs["encode"]["vae2d"] - outputs["encode"]["conv3d"]).abs().max()),
            "encode_abs_max": float(outputs["encode"]["conv3d"].abs().max()),
        }
        report["results"][f"{size}x{size}"] = row
        print(size, json.dumps(row), flush=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
