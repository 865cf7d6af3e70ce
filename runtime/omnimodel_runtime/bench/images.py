"""Images mode (``/v1/images/generations``): latency against diffusers called directly (sequential,
interleaved, same prompts and seeds), images/s through the gateway at each concurrency, and pixel
comparisons (the gateway's image against diffusers', each batched image against the same request alone)."""

# Imports sit inside functions on purpose: each mode pulls in only what it needs.
# ruff: noqa: PLC0415

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass
from typing import Any, Final

from omnimodel_runtime.bench.common import GatewayClient, concurrently, device, latency_ratios, pct

IMAGE_PROMPTS: Final = (
    "a red fox in the snow",
    "a watercolor painting of a lighthouse on a rocky coast at sunset, with seagulls and a small boat",
    "an astronaut riding a horse",
    "a wooden cabin in a pine forest under a starry night sky",
    "a bowl of ramen",
    "a robot holding a sign that says hello world, photo, shallow depth of field",
    "an old castle on a mountain",
    "a glass of orange juice on a table next to a stack of books and a small green plant",
)


def selected(args: argparse.Namespace) -> bool:
    from omnimodel_runtime.pipeline import Route, get_preset

    if args.mode != "auto":
        return bool(args.mode == "images")
    return Route.IMAGES in get_preset(args.preset).routes


def image_size(args: argparse.Namespace) -> tuple[int, int]:
    from omnimodel_runtime.protocol.images import parse_size

    return parse_size(args.size)


def _image_params(args: argparse.Namespace) -> dict[str, Any]:
    """Diffusion parameters both paths use (classifier-free guidance only with a negative prompt)."""
    width, height = image_size(args)
    params: dict[str, Any] = {"width": width, "height": height, "num_inference_steps": args.steps}
    if args.negative_prompt is not None:
        params["negative_prompt"] = args.negative_prompt
        params["true_cfg_scale"] = args.true_cfg_scale
    return params


@dataclass
class ImageSample:
    latency: float
    image: Any  # the first image's pixels (uint8 HxWx3), for the pixel comparisons


class ImagesClient(GatewayClient):
    """``/v1/images/generations`` requests with the run's diffusion parameters."""

    def __init__(self, url: str, api_key: str | None, params: dict[str, Any]) -> None:
        super().__init__(url, api_key)
        self.params = params

    async def generate(self, prompt: str, seed: int) -> ImageSample:
        p = self.params
        body = {
            "model": self.model,
            "prompt": prompt,
            "size": f"{p['width']}x{p['height']}",
            "seed": seed,
            **{k: v for k, v in p.items() if k not in ("width", "height")},
        }
        started = time.perf_counter()
        resp = await self._client.post("/v1/images/generations", json=body)
        resp.raise_for_status()
        latency = time.perf_counter() - started
        return ImageSample(latency, resp.json()["data"][0]["b64_json"])


def _png_pixels(b64: str) -> Any:
    import base64
    import io

    import numpy as np
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))))


class _DirectDiffusers:
    """The diffusers pipeline itself in this process: ``pipe(prompt, ...)``, PIL images out."""

    def __init__(self, args: argparse.Namespace, params: dict[str, Any]) -> None:
        import torch
        from diffusers import DiffusionPipeline

        from omnimodel_runtime.models import resolve_model_dir
        from omnimodel_runtime.pipeline import ModelSource
        from omnimodel_runtime.settings import RuntimeSettings

        self.device = device()
        model_dir = resolve_model_dir(ModelSource(source=args.model), RuntimeSettings())
        dtype = torch.float32 if self.device == "cpu" else torch.bfloat16
        self.pipe = DiffusionPipeline.from_pretrained(model_dir, dtype=dtype).to(self.device)
        self.pipe.set_progress_bar_config(disable=True)
        self.params = params

    def _call(self, prompts: list[str], seeds: list[int]) -> list[Any]:
        import numpy as np
        import torch

        p = self.params
        kwargs = {"negative_prompt": [p["negative_prompt"]] * len(prompts)} if "negative_prompt" in p else {}
        images = self.pipe(
            prompts,
            width=p["width"],
            height=p["height"],
            num_inference_steps=p["num_inference_steps"],
            true_cfg_scale=p.get("true_cfg_scale", 1.0),
            generator=[torch.Generator("cpu").manual_seed(s) for s in seeds],
            **kwargs,
        ).images
        return [np.asarray(image) for image in images]

    def run(self, prompt: str, seed: int) -> ImageSample:
        started = time.perf_counter()
        (image,) = self._call([prompt], [seed])
        return ImageSample(time.perf_counter() - started, image)

    def run_batch(self, prompts: list[str], seeds: list[int]) -> float:
        started = time.perf_counter()
        self._call(prompts, seeds)
        return time.perf_counter() - started


def _image_summary(samples: list[ImageSample], wall: float, concurrency: int) -> dict[str, Any]:
    lat = [s.latency for s in samples]
    return {
        "concurrency": concurrency,
        "requests": len(samples),
        "wall_s": round(wall, 3),
        "images_per_s": round(len(samples) / wall, 4) if wall > 0 else None,
        "latency_p50_s": round(pct(lat, 50), 4),
        "latency_p99_s": round(pct(lat, 99), 4),
        "latency_mean_s": round(statistics.fmean(lat), 4) if lat else None,
    }


def _png_encode_seconds(pixels: Any) -> float:
    from omnimodel_runtime.serving.images import encode_png

    started = time.perf_counter()
    encode_png(pixels)
    return time.perf_counter() - started


def _pixel_diff(a: Any, b: Any) -> dict[str, Any]:
    import numpy as np

    diff = np.abs(np.asarray(a, dtype=np.int16) - np.asarray(b, dtype=np.int16))
    return {"max": int(diff.max()), "equal_fraction": round(float((diff == 0).mean()), 6)}


async def measure(args: argparse.Namespace, url: str) -> dict[str, Any]:
    """Latency against diffusers called directly (sequential, interleaved, same prompts and seeds), then
    images/s through the gateway at each concurrency; the batching factor is images/s at the highest
    concurrency over images/s at 1. Pixels are compared too: the gateway's image against diffusers'
    (split equals whole), and each image made in a batch against the same request made alone."""
    params = _image_params(args)
    client = ImagesClient(url, args.api_key, params)
    result: dict[str, Any] = {}
    pairs = [(IMAGE_PROMPTS[i % len(IMAGE_PROMPTS)], 1000 + i) for i in range(len(IMAGE_PROMPTS))]
    alone: dict[tuple[str, int], Any] = {}
    try:
        client.model = await client.model_id()
        await client.generate(*pairs[0])  # connections, allocator and kernel selection at this size
        direct = None
        if not args.no_direct:
            direct = await asyncio.to_thread(_DirectDiffusers, args, params)
            await asyncio.to_thread(direct.run, *pairs[0])

        async def overhead() -> None:
            assert direct is not None
            d_lat, g_lat, ratios, diffs = [], [], [], []
            for _ in range(args.rounds):
                for prompt, seed in pairs[: args.overhead_prompts]:
                    d = await asyncio.to_thread(direct.run, prompt, seed)
                    g = await client.generate(prompt, seed)
                    g_pixels = await asyncio.to_thread(_png_pixels, g.image)
                    alone[(prompt, seed)] = g_pixels
                    d_lat.append(d.latency)
                    g_lat.append(g.latency)
                    ratios.append(g.latency / d.latency)
                    diffs.append(_pixel_diff(g_pixels, d.image))
            result["overhead"] = {
                "pairs": len(ratios),
                **latency_ratios(d_lat, g_lat, ratios),
                "pixels_equal_to_diffusers": sum(d["max"] == 0 for d in diffs),
                "max_pixel_diff_to_diffusers": max(d["max"] for d in diffs),
                # Part of the gateway's added latency that the direct call does not do: one PNG.
                "png_encode_ms": round(await asyncio.to_thread(_png_encode_seconds, g_pixels) * 1000, 2),
                "direct_latencies_s": [round(v, 4) for v in d_lat],
                "gateway_latencies_s": [round(v, 4) for v in g_lat],
            }

        async def throughput() -> None:
            levels: dict[str, Any] = {}
            batched_diffs = []
            for concurrency in args.image_concurrency:
                count = max(args.image_requests, 2 * concurrency)
                todo = [pairs[i % len(pairs)] for i in range(count)]
                made, wall = await concurrently(lambda item: _generated(client, item), todo, concurrency)
                samples = [sample for _, sample in made]
                levels[str(concurrency)] = _image_summary(samples, wall, concurrency)
                if concurrency > 1:
                    for item, sample in made:
                        if item in alone:
                            pixels = await asyncio.to_thread(_png_pixels, sample.image)
                            batched_diffs.append(_pixel_diff(pixels, alone[item]))
            result["gateway"] = levels
            low, high = min(args.image_concurrency), max(args.image_concurrency)
            result["batching_factor"] = round(levels[str(high)]["images_per_s"] / levels[str(low)]["images_per_s"], 3)
            result["latency_per_image_s"] = levels[str(low)]["latency_p50_s"]
            if batched_diffs:
                result["batched_vs_alone"] = {
                    "compared": len(batched_diffs),
                    "max_pixel_diff": max(d["max"] for d in batched_diffs),
                    "min_equal_fraction": min(d["equal_fraction"] for d in batched_diffs),
                }

        async def direct_batch() -> None:
            assert direct is not None
            n = max(args.image_concurrency)
            prompts = [pairs[i % len(pairs)][0] for i in range(n)]
            seconds = await asyncio.to_thread(direct.run_batch, prompts, [s for _, s in pairs[:n]])
            result["direct_diffusers_batch"] = {
                "images": n,
                "wall_s": round(seconds, 3),
                "images_per_s": round(n / seconds, 4),
            }

        sections = [("throughput", throughput)]
        if direct is not None:
            sections = [("overhead", overhead), *sections, ("direct_batch", direct_batch)]
        # A run on a lent accelerator may be cut short: what is measured so far is kept in OUT.tmp.
        partial = args.out.with_name(args.out.name + ".tmp") if args.out is not None else None
        for name, section in sections:
            try:
                await section()
            except Exception as err:  # one run's numbers are costly: record the failure, keep measuring
                result.setdefault("errors", {})[name] = f"{type(err).__name__}: {err}"
            if partial is not None:
                partial.parent.mkdir(parents=True, exist_ok=True)
                partial.write_text(json.dumps(result, indent=2) + "\n")
        if partial is not None:
            partial.unlink(missing_ok=True)
    finally:
        await client.aclose()
    return result


async def _generated(client: ImagesClient, item: tuple[str, int]) -> tuple[tuple[str, int], ImageSample]:
    return item, await client.generate(*item)
