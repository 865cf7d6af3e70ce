"""The text-to-image engine's speed options on one pipeline, in one process: eager (diffusers as it is), then
the engine's ``cache`` and ``compile`` options applied by the engine's own code (``_speed_up``), each timed
on the same prompt and seed, with the pixel difference from the eager image of the same seed.
``taylorseer-blocks`` is ``cache: taylorseer`` with ``cache_scope: blocks``; ``fuse``: ``fuse_blocks``.
``notriton`` (with ``fuse``): the blocks' query/key norms and rotations in PyTorch operations instead of
engines/t2i/kernels.py's Triton kernel (a group of its own). ``cfgbatch`` in a variant's name adds
``cfg_batch`` (both guidance branches in one transformer call, the engine's :class:`BatchedGuidance` around
the pipeline call). Variants that differ only in it form one group on the same transformer state, timed in
alternating runs (``a b a b ...``) so that drift hits both alike;
a ``cfgbatch`` variant also gets its pixel difference from its sequential twin. ``vae2d`` in a variant's name
adds ``vae_2d`` (the VAE's causal 3D convolutions as 2D ones on the one frame); it shares its twin's group,
alternates with it, and gets its pixel difference from it. ``hostround``: the decoded image rounded to uint8 on
the host, as the engine did before it rounded on the image's device (the same group; its pixel difference
from its twin should be 0).

The prompts are encoded as the engine's encode stage encodes them (the family's ``encode``, then the
pipeline call on the embeddings, as the denoise stage makes it); under ``cfg_batch`` both prompts in one
text-encoder pass (``encode_together``), except in a ``seqenc`` variant (one after the other, as without
it), which shares its group and alternates with its twin.

    python bench/t2i_speed.py --model /dev/shm/qwen-image --sizes 512,1024 --steps 20 --out result.json

Loads the pipeline once (a full ``omnimodel bench`` per option would load it twice more per option); the
numbers are one request's whole path through the engine's stages: encode, the denoise call, and the decode
stage's ``family.decode`` (the VAE, then pixels rounded on the image's device; runs before this file's commit
8bd3ceb timed the pipeline's own PIL tail, rounded on the host). Writes the JSON after every size of a
group, so a run cut short keeps what it measured.
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

from omnimodel_runtime.engines.t2i import fused as fused_blocks_module
from omnimodel_runtime.engines.t2i import qwen_image as qwen_image_module
from omnimodel_runtime.engines.t2i.diffusers import DiffusersImageEngine
from omnimodel_runtime.engines.t2i.families import family_for
from omnimodel_runtime.engines.t2i.fused import ModulationSchedule, unfuse_blocks
from omnimodel_runtime.engines.t2i.guidance import BatchedGuidance
from omnimodel_runtime.engines.t2i.vae import undo_vae_2d, vae_2d

PROMPT = "A red fox in a snowy forest at dawn, photograph"
NEGATIVE = " "
OTHER_PROMPT = "An old lighthouse on a rocky coast under a stormy sky, oil painting, wide angle"
# Qwen-Image's family rounds its images with to_uint8, imported by name into its module: the hostround
# variant swaps that module's reference.
DEVICE_UINT8 = vars(qwen_image_module)["to_uint8"]


def host_uint8(pipe: Any, image: torch.Tensor) -> np.ndarray:
    """The engine's rounding before it moved to the image's device: float32 on the host."""
    floats = np.nan_to_num(pipe.image_processor.postprocess(image, output_type="np"), nan=0.0)
    return np.asarray((floats * 255).round().astype(np.uint8))


def mask_effect(pipe: Any, size: int) -> dict[str, Any]:
    """What padding a prompt and masking the padding does to one eager transformer call (bf16), and what
    a batch of two does: max |difference| of the noise prediction, against its largest magnitude."""
    embeds, _ = pipe.encode_prompt(PROMPT, device=pipe._execution_device)
    side = size // pipe.vae_scale_factor // 2
    gen = torch.Generator("cpu").manual_seed(0)
    latents = torch.randn((1, side * side, pipe.transformer.config.in_channels), generator=gen)
    latents = latents.to(embeds.device, embeds.dtype)
    timestep = torch.full((1,), 0.5, device=embeds.device, dtype=embeds.dtype)

    def call(x: torch.Tensor, e: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
        b = x.shape[0]
        with torch.inference_mode():
            out: torch.Tensor = pipe.transformer(
                hidden_states=x,
                timestep=timestep.expand(b),
                encoder_hidden_states=e,
                encoder_hidden_states_mask=m,
                img_shapes=[[(1, side, side)]] * b,
                return_dict=False,
            )[0]
        return out.float()

    alone = call(latents, embeds, None)
    # The same prompt right-padded with 8 zero tokens, masked as a batch of prompts of other lengths is.
    padded = torch.nn.functional.pad(embeds, (0, 0, 0, 8))
    mask = torch.ones(padded.shape[:2], dtype=torch.long, device=embeds.device)
    mask[:, embeds.shape[1] :] = 0
    masked = call(latents, padded, mask)
    pair = call(torch.cat([latents, latents]), torch.cat([embeds, embeds]), None)[:1]
    scale = float(alone.abs().max())
    return {
        "prompt_tokens": int(embeds.shape[1]),
        "padding_tokens": 8,
        "noise_pred_abs_max": round(scale, 4),
        "padded_and_masked_max_abs_diff": round(float((masked - alone).abs().max()), 6),
        "batch_of_two_max_abs_diff": round(float((pair - alone).abs().max()), 6),
    }


def encode_effect(pipe: Any, family: Any, max_sequence_length: int, runs: int = 5) -> dict[str, Any]:
    """The prompt and the negative prompt encoded one after the other (``encode``) and in one pass
    (``encode_together``, ``cfg_batch``): p50 seconds of each, alternating, and max |difference| of the rows."""
    times: dict[str, list[float]] = {"encode": [], "encode_together": []}
    rows: dict[str, Any] = {}
    with torch.inference_mode():
        for _ in range(runs + 1):
            for name, taken in times.items():
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                rows[name] = getattr(family, name)(pipe, PROMPT, NEGATIVE, max_sequence_length).tensors
                torch.cuda.synchronize()
                taken.append(time.perf_counter() - t0)
    one, two = rows["encode"], rows["encode_together"]
    return {f"{name}_p50_s": round(statistics.median(ts[1:]), 4) for name, ts in times.items()} | {
        "prompt_tokens": [int(one[k].shape[1]) for k in ("prompt_embeds", "negative_prompt_embeds")],
        "embeds_abs_max": round(float(one["prompt_embeds"].abs().max()), 4),
        "together_max_abs_diff": round(max(float((one[k] - two[k]).abs().max()) for k in one), 6),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, type=Path)
    p.add_argument("--sizes", default="512,1024")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--cfg", type=float, default=4.0)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--variants", default="eager,cfgbatch,taylorseer,regional,regional+cfgbatch")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", required=True, type=Path)
    args = p.parse_args()
    cuda = args.device == "cuda"

    started = time.perf_counter()
    pipe = DiffusionPipeline.from_pretrained(args.model, dtype=torch.bfloat16 if cuda else torch.float32)
    pipe = pipe.to(args.device)
    pipe.set_progress_bar_config(disable=True)
    family = family_for(args.model)[0]
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

    max_sequence_length = family.defaults(type(pipe), args.model).max_sequence_length

    def image(size: int, variant: str, prompt: str = PROMPT) -> tuple[np.ndarray, float]:
        cfg_batch = "cfgbatch" in variant
        # The engine's vae_2d, on or off for this call (its twin shares the pipeline).
        (vae_2d if "vae2d" in variant else undo_vae_2d)(pipe.vae)
        vars(qwen_image_module)["to_uint8"] = host_uint8 if "hostround" in variant else DEVICE_UINT8
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        # The engine's encode stage, then its denoise call on the embeddings (engines/t2i/diffusers.py).
        encode = family.encode_together if cfg_batch and "seqenc" not in variant else family.encode
        conditioning = encode(pipe, prompt, NEGATIVE, max_sequence_length)
        kwargs, inputs = family.denoise_inputs(pipe, [(conditioning, 1)], None)
        guidance = BatchedGuidance(pipe, family.merge_guidance) if cfg_batch else contextlib.nullcontext()
        # As the engine runs a fused transformer: each step's modulation rows from one table a call.
        schedule = ModulationSchedule(pipe)
        with guidance, schedule, inputs:
            latents = pipe(
                **kwargs,
                true_cfg_scale=args.cfg,
                width=size,
                height=size,
                num_inference_steps=args.steps,
                generator=torch.Generator("cpu").manual_seed(0),
                output_type="latent",
            ).images
        # The engine's decode stage (under inference mode, as its serve loop runs): the VAE, then the pixels
        # rounded as diffusers' PIL output rounds them.
        with torch.inference_mode():
            out = family.decode(pipe, latents, size, size)[0]
        if cuda:
            torch.cuda.synchronize()
        if isinstance(guidance, BatchedGuidance):
            assert guidance.batched_calls == guidance.answered_calls == args.steps, "cfg_batch did not engage"
        return np.asarray(out).astype(np.int16), time.perf_counter() - t0

    def differences(img: np.ndarray, ref: np.ndarray, suffix: str) -> dict[str, Any]:
        diff = np.abs(img - ref)
        mse = max(float((diff.astype(np.float64) ** 2).mean()), 1e-12)
        return {
            f"max_pixel_diff_vs_{suffix}": int(diff.max()),
            f"mean_pixel_diff_vs_{suffix}": round(float(diff.mean()), 3),
            f"psnr_db_vs_{suffix}": round(float(10 * np.log10(255**2 / mse)), 2),
        }

    def measure(group: list[str], sections: dict[str, dict[str, Any]]) -> None:
        for size in sizes:
            images: dict[str, np.ndarray] = {}
            times: dict[str, list[float]] = {v: [] for v in group}
            first: dict[str, float] = {}
            wall = time.perf_counter()
            for variant in group:  # warm-up (and compilation, for compiled variants)
                images[variant], first[variant] = image(size, variant)
            for _ in range(args.runs):
                for variant in group:
                    images[variant], took = image(size, variant)
                    times[variant].append(took)
            # A prompt of another token count after the timed runs: what a server's next request pays
            # (a compiled variant that had to compile again for it shows it here).
            other = {variant: image(size, variant, OTHER_PROMPT)[1] for variant in group}
            for variant in group:
                row: dict[str, Any] = {
                    "first_call_s": round(first[variant], 3),
                    "other_prompt_s": round(other[variant], 3),
                    "latency_p50_s": round(statistics.median(times[variant]), 4),
                    "latencies_s": [round(t, 4) for t in times[variant]],
                    "group_wall_s": round(time.perf_counter() - wall, 1),
                }
                if variant == "eager":
                    reference[size] = images[variant]
                elif size in reference:
                    row |= differences(images[variant], reference[size], "eager")
                twin = variant.replace("+seqenc", "").replace("+cfgbatch", "").replace("cfgbatch", "eager")
                if "cfgbatch" in variant and twin in images:
                    row |= differences(images[variant], images[twin], "sequential")
                conv3d = variant.replace("+vae2d", "")
                if "vae2d" in variant and conv3d in images:
                    row |= differences(images[variant], images[conv3d], "conv3d")
                on_device = variant.replace("+hostround", "")
                if "hostround" in variant and on_device in images:
                    row |= differences(images[variant], images[on_device], "device_rounding")
                together = variant.replace("+seqenc", "")
                if "seqenc" in variant and together in images:
                    row |= differences(images[variant], images[together], "encoded_together")
                sections[variant][f"{size}x{size}"] = row
                print(variant, size, row, flush=True)
            args.out.write_text(json.dumps(report, indent=2) + "\n")

    def engine_args_of(variant: str) -> dict[str, Any]:
        engine_args: dict[str, Any] = {}
        if "taylorseer" in variant:
            engine_args["cache"] = "taylorseer"
            if "blocks" in variant:  # taylorseer-blocks: whole blocks predicted, not only their attention
                engine_args["cache_scope"] = "blocks"
        if "regional" in variant:
            engine_args["compile"] = "regional"
        if "fuse" in variant:
            engine_args["fuse_blocks"] = True
        for backend in ("cudnn", "flash", "efficient"):
            if backend in variant:
                engine_args["attention"] = backend
        return engine_args

    report["meta"]["mask_effect"] = mask_effect(pipe, sizes[0])
    print("mask effect", report["meta"]["mask_effect"], flush=True)
    if cuda:
        report["meta"]["encode_effect"] = encode_effect(pipe, family, max_sequence_length)
        print("encode effect", report["meta"]["encode_effect"], flush=True)
    groups: dict[str, list[str]] = {}
    for variant in args.variants.split(","):
        key = json.dumps([engine_args_of(variant), "notriton" in variant], sort_keys=True)
        groups.setdefault(key, []).append(variant)
    has_triton = fused_blocks_module._HAS_TRITON
    for key, group in groups.items():
        engine_args, notriton = json.loads(key)
        fused_blocks_module._HAS_TRITON = has_triton and not notriton
        sections: dict[str, dict[str, Any]] = {}
        for variant in group:
            sections[variant] = {"engine_args": engine_args | ({"cfg_batch": True} if "cfgbatch" in variant else {})}
            report["results"][variant] = sections[variant]
        torch._dynamo.reset()  # each compiled group compiles afresh (and counts its own recompilations)
        try:
            if engine_args:
                # The engine's own code for these engine_args, on this pipeline.
                stage = SimpleNamespace(engine_args=engine_args, name="bench")
                fake = SimpleNamespace(context=SimpleNamespace(stage=stage), stage=stage)
                DiffusersImageEngine._speed_up(fake, pipe)  # type: ignore[arg-type]
            measure(group, sections)
        except Exception as err:  # a group that fails leaves the others' numbers
            for variant in group:
                sections[variant]["error"] = f"{type(err).__name__}: {err}"
            print(group, "failed:", f"{type(err).__name__}: {err}", flush=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        if engine_args.get("cache"):
            pipe.transformer.disable_cache()
        if engine_args.get("fuse_blocks"):
            unfuse_blocks(pipe.transformer)
        if engine_args.get("attention"):  # the next group picks its own kernel again
            pipe.transformer.set_attention_backend("native")
        for block in pipe.transformer.modules():  # undo compile: regional (module call or the blocks' forward)
            if getattr(block, "_compiled_call_impl", None) is not None:
                block._compiled_call_impl = None
            if "forward" in vars(block) and hasattr(block.forward, "_torchdynamo_orig_callable"):
                del block.forward
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
