"""Where one Qwen-Image transformer call's GPU time goes, and what the exact path's options buy per call: the
whole 60-block transformer with random bf16 weights (no text encoder, no VAE: a request at 1024² is 40 of
these calls plus ~0.15 s), one image of ``--size``, a prompt of ``--prompt-tokens`` tokens, no mask.

- ``floor``: the block's matrix products (image and text streams) and its joint attention timed alone with
  PyTorch's kernels (cuBLAS; flash / cuDNN / memory-efficient SDPA), times the block count: what a call
  costs if nothing else ran;
- ``variants``: p50 of ``--runs`` calls (CUDA events) of the transformer as the engine configures it
  (``eager``, ``regional``: ``compile_repeated_blocks``), with ``fuse`` (the engine's ``fuse_blocks``),
  ``autotune`` (inductor's ``max_autotune`` GEMM search), ``cdt`` (inductor's coordinate-descent tuning of its
  own kernels' block sizes) or ``cudnn`` (the attention pinned to cuDNN's kernel); each variant's output
  against eager's (max |diff|). ``cfg``: one call on both guidance branches as ``cfg_batch`` makes it (the
  negative prompt of ``--negative-tokens`` right-padded and masked; with ``fuse``, the rows' lengths passed as
  the family passes them): ``call_ms_p50`` is that call, ``per_branch_ms`` half of it, and the max |diff| is
  each row's against eager's call on that branch. ``table`` (with ``fuse``): the calls under one
  ``ModulationSchedule``, each copying its modulation rows from the table as a request's steps do (without it
  a fused call computes its rows, outside the compiled blocks); ``table_build_ms`` is what the first call of a
  request pays for ``--steps`` timesteps' rows. ``notriton`` (with ``fuse``): the blocks' query/key norms and
  rotations in PyTorch operations (inductor's kernels) instead of engines/t2i/kernels.py's Triton kernel, the
  path a torch without Triton takes; other parts (``r2``) are ignored, so a variant can run twice in one run;
- ``gpu``: the SM clock and board power while each variant's calls ran (``nvidia-smi``), and idle;
- ``sustained`` (``--sustain SECONDS``): the board at its power limit clocks down after a few calls, so
  short timings flatter it. Back-to-back calls for that long, the p50 of the second half's calls and the
  clocks meanwhile: for each variant, and for ``floor_chain``, the irreducible part of a ``cfg_batch``
  call (every block's own image and text products with its own weights and biases, and one cuDNN attention
  per branch over its own length; no norms, no modulation, no rotation), what the exact path costs if all
  other work were free;
- ``gelu_epilogue``: ``linear_gelu`` (cuBLASLt's GELU epilogue) against the unfused product and tanh GELU
  in fp32 and bf16, on the MLP's shape (a GELU other than the tanh one would show as ~1e-3);
- ``kernels``: each variant's kernels under ``torch.profiler``, grouped (matmul, attention,
  fused elementwise, other), ms a call.

    python bench/t2i_kernels.py --size 1024 --out t2i-kernels.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from diffusers import QwenImageTransformer2DModel

from omnimodel_runtime.engines.t2i import fused as fused_blocks_module
from omnimodel_runtime.engines.t2i.fused import MODULATIONS, ModulationSchedule, fuse_blocks, linear_gelu


def cuda_events() -> tuple[Any, Any]:
    """A timing pair (``torch.cuda.Event`` has no annotations)."""
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


def cuda_ms(fn: Callable[[], Any], runs: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        start, end = cuda_events()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(statistics.median(times))


def floor(config: Any, image_tokens: int, text_tokens: int, runs: int) -> dict[str, Any]:
    dim = config.num_attention_heads * config.attention_head_dim
    x = torch.randn(image_tokens, dim, device="cuda", dtype=torch.bfloat16)
    xt = torch.randn(text_tokens, dim, device="cuda", dtype=torch.bfloat16)
    h = torch.randn(image_tokens, 4 * dim, device="cuda", dtype=torch.bfloat16)
    ht = torch.randn(text_tokens, 4 * dim, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(dim, dim, device="cuda", dtype=torch.bfloat16)
    w3 = torch.randn(3 * dim, dim, device="cuda", dtype=torch.bfloat16)
    up = torch.randn(4 * dim, dim, device="cuda", dtype=torch.bfloat16)
    down = torch.randn(dim, 4 * dim, device="cuda", dtype=torch.bfloat16)
    shapes = {
        "qkv_separate": lambda: [F.linear(a, w) for a in (x, x, x, xt, xt, xt)],
        "qkv_fused": lambda: [F.linear(a, w3) for a in (x, xt)],
        "out": lambda: [F.linear(a, w) for a in (x, xt)],
        "mlp": lambda: [F.linear(x, up), F.linear(h, down), F.linear(xt, up), F.linear(ht, down)],
    }
    out: dict[str, Any] = {}
    for name, fn in shapes.items():
        out[f"{name}_ms"] = round(cuda_ms(fn, runs), 4)
    s = image_tokens + text_tokens
    q, k, v = (
        torch.randn(1, config.num_attention_heads, s, config.attention_head_dim, device="cuda", dtype=torch.bfloat16)
        for _ in range(3)
    )
    backends = {
        "flash": torch.nn.attention.SDPBackend.FLASH_ATTENTION,
        "cudnn": torch.nn.attention.SDPBackend.CUDNN_ATTENTION,
        "efficient": torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION,
    }
    for name, backend in backends.items():
        try:
            with torch.nn.attention.sdpa_kernel(backend):
                out[f"attention_{name}_ms"] = round(cuda_ms(lambda: F.scaled_dot_product_attention(q, k, v), runs), 4)
        except RuntimeError as exc:
            out[f"attention_{name}_ms"] = f"failed: {str(exc)[:120]}"
    block = out["qkv_separate_ms"] + out["out_ms"] + out["mlp_ms"]
    attention = min(v for k_, v in out.items() if k_.startswith("attention_") and isinstance(v, float))
    flops = 2 * (image_tokens + text_tokens) * (4 * dim * dim + 8 * dim * dim) + 4 * s * s * dim
    out["block_matmul_ms"] = round(block, 4)
    out["call_floor_ms"] = round(config.num_layers * (block + attention), 2)
    out["block_tflop"] = round(flops / 1e12, 4)
    out["call_tflop"] = round(config.num_layers * flops / 1e12, 2)
    out["matmul_tflops_per_s"] = round(2 * (image_tokens + text_tokens) * 12 * dim * dim / (block * 1e-3) / 1e12, 1)
    out["attention_tflops_per_s"] = round(4 * s * s * dim / (attention * 1e-3) / 1e12, 1)
    return out


@contextlib.contextmanager
def gpu_clocks(into: dict[str, Any]) -> Iterator[None]:
    """The SM clock and board power ``nvidia-smi`` samples every 100 ms while the block runs: medians into
    ``into`` (a GPU at its power limit runs its kernels at a lower clock)."""
    query = "--query-gpu=clocks.sm,clocks.max.sm,power.draw,power.limit"
    sampler = subprocess.Popen(
        ["nvidia-smi", query, "--format=csv,noheader,nounits", "-lms", "100"], stdout=subprocess.PIPE, text=True
    )
    try:
        yield
    finally:
        sampler.terminate()
        out, _ = sampler.communicate()
    rows = []
    for line in out.splitlines():
        with contextlib.suppress(ValueError):  # "[N/A]" where a board does not report a field
            rows.append([float(v) for v in line.split(",")])
    rows = [r for r in rows if len(r) == 4]
    if rows:
        for i, name in enumerate(("sm_clock_mhz", "max_sm_clock_mhz", "power_w", "power_limit_w")):
            into[f"{name}_p50"] = statistics.median(r[i] for r in rows)
        into["samples"] = len(rows)


def sustained(fn: Callable[[], Any], seconds: float) -> dict[str, Any]:
    """``fn`` back to back for ``seconds``: the p50 of the second half's calls (CUDA events) and the clocks."""
    times: list[float] = []
    row: dict[str, Any] = {"gpu": {}}
    with gpu_clocks(row["gpu"]):
        until = time.perf_counter() + seconds
        while time.perf_counter() < until:
            start, end = cuda_events()
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    late = times[len(times) // 2 :]
    row.update({"calls": len(times), "call_ms_p50": round(statistics.median(late), 2)})
    row["call_ms_first_p50"] = round(statistics.median(times[: max(1, min(5, len(times)))]), 2)
    return row


def floor_chain(model: Any, image: torch.Tensor, branches: list[torch.Tensor]) -> Callable[[], Any]:
    """The irreducible work of one ``cfg_batch`` call (module docstring, ``sustained``): the blocks'
    products with their own weights, and each branch's attention over its own text length."""
    dim = model.config.num_attention_heads * model.config.attention_head_dim
    heads, head_dim = model.config.num_attention_heads, model.config.attention_head_dim
    rows = len(branches)
    x = torch.randn(rows * image.shape[1], dim, device="cuda", dtype=torch.bfloat16)
    width = max(b.shape[1] for b in branches)
    xt = torch.randn(rows * width, dim, device="cuda", dtype=torch.bfloat16)
    qkv = [
        torch.randn(1, heads, image.shape[1] + b.shape[1], head_dim, device="cuda", dtype=torch.bfloat16)
        for b in branches
    ]

    def run() -> None:
        with torch.inference_mode(), torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            for block in model.transformer_blocks:
                a = block.attn
                for stream, (q, k, v, o), mlp in (
                    (x, (a.to_q, a.to_k, a.to_v, a.to_out[0]), block.img_mlp),
                    (xt, (a.add_q_proj, a.add_k_proj, a.add_v_proj, a.to_add_out), block.txt_mlp),
                ):
                    for proj in (q, k, v, o):
                        F.linear(stream, proj.weight, proj.bias)
                    up, down = mlp.net[0].proj, mlp.net[2]
                    F.linear(F.linear(stream, up.weight, up.bias), down.weight, down.bias)
                for t in qkv:
                    F.scaled_dot_product_attention(t, t, t)

    return run


def _gelu_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.gelu(F.linear(x, w, b), approximate="tanh")


def gelu_check(config: Any) -> dict[str, Any]:
    dim = config.num_attention_heads * config.attention_head_dim
    out: dict[str, Any] = {}
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(4096, dim, device="cuda", dtype=dtype)
        w = torch.randn(4 * dim, dim, device="cuda", dtype=dtype) / dim**0.5
        b = torch.randn(4 * dim, device="cuda", dtype=dtype)
        fused = linear_gelu(x, w, b).float()
        pre = F.linear(x.float(), w.float(), b.float())
        name = str(dtype).removeprefix("torch.")
        out[f"{name}_vs_tanh_max_abs_diff"] = round(float((fused - F.gelu(pre, approximate="tanh")).abs().max()), 6)
        out[f"{name}_vs_erf_max_abs_diff"] = round(float((fused - F.gelu(pre)).abs().max()), 6)
        ms = cuda_ms(functools.partial(linear_gelu, x, w, b), 20)
        unfused = cuda_ms(functools.partial(_gelu_linear, x, w, b), 20)
        out[f"{name}_fused_ms"], out[f"{name}_unfused_ms"] = round(ms, 4), round(unfused, 4)
    return out


def kernel_groups(fn: Callable[[], Any], calls: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    groups: dict[str, float] = {"matmul": 0.0, "attention": 0.0, "fused_elementwise": 0.0, "other": 0.0}
    top: dict[str, float] = {}
    for event in prof.key_averages():
        us = event.device_time_total
        if us <= 0:
            continue
        name = event.key.lower()
        if any(t in name for t in ("flash", "fmha", "cudnn", "attention", "sdpa")):
            group = "attention"
        elif any(t in name for t in ("gemm", "nvjet", "xmma", "cutlass", "sm90", "matmul", "splitk")):
            group = "matmul"
        elif name.startswith("triton"):
            group = "fused_elementwise"
        else:
            group = "other"
        groups[group] += us / 1000 / calls
        top[event.key[:90]] = us / 1000 / calls
    return {
        "ms_per_call": {k: round(v, 2) for k, v in groups.items()},
        "total_ms_per_call": round(sum(groups.values()), 2),
        "top_kernels_ms_per_call": {k: round(v, 3) for k, v in sorted(top.items(), key=lambda kv: -kv[1])[:15]},
    }


def table_build_ms(model: Any, kwargs: dict[str, Any], steps: int) -> float:
    """What one request pays once under ``table``: every step's modulation rows for ``steps`` timesteps."""
    modulations = getattr(model, MODULATIONS)
    saved = modulations.scheduler, modulations.table
    modulations.scheduler = SimpleNamespace(timesteps=torch.linspace(1000, 50, steps, device="cuda"))

    def build() -> None:
        modulations.table = None
        with torch.inference_mode():
            modulations.fill(model, kwargs["timestep"], kwargs["hidden_states"])

    try:
        return round(cuda_ms(build, 5), 2)
    finally:
        modulations.scheduler, modulations.table = saved


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--prompt-tokens", type=int, default=20)
    p.add_argument("--negative-tokens", type=int, default=6)
    p.add_argument("--layers", type=int, default=60)
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--variants", default="eager,regional,regional+fuse,regional+cfg,regional+fuse+cfg")
    p.add_argument("--steps", type=int, default=20, help="timesteps of the table ``table`` builds once a request")
    p.add_argument("--sustain", type=float, default=0.0, help="seconds of back-to-back calls per variant")
    p.add_argument("--out", required=True, type=Path)
    args = p.parse_args()
    torch.manual_seed(0)
    # Built in float32 and cast, as make-tiny builds it.
    with torch.device("cuda"):
        base = QwenImageTransformer2DModel(num_layers=args.layers).eval().to(torch.bfloat16)
    config = base.config
    side = args.size // 16
    gen = torch.Generator("cuda").manual_seed(0)
    image = torch.randn(1, side * side, config.in_channels, device="cuda", generator=gen).bfloat16()
    text = torch.randn(1, args.prompt_tokens, config.joint_attention_dim, device="cuda", generator=gen).bfloat16()
    negative = torch.randn(1, args.negative_tokens, config.joint_attention_dim, device="cuda", generator=gen)
    negative = negative.bfloat16()

    def inputs(rows: list[torch.Tensor], lengths: bool) -> dict[str, Any]:
        width = max(r.shape[1] for r in rows)
        mask = torch.zeros(len(rows), width, dtype=torch.long, device="cuda")
        for i, r in enumerate(rows):
            mask[i, : r.shape[1]] = 1
        padded = torch.cat([F.pad(r, (0, 0, 0, width - r.shape[1])) for r in rows])
        return {
            "hidden_states": image.expand(len(rows), -1, -1),
            "encoder_hidden_states": padded,
            "encoder_hidden_states_mask": None if len(rows) == 1 else mask,
            "timestep": torch.full((len(rows),), 0.5, device="cuda", dtype=torch.bfloat16),
            "img_shapes": [[(1, side, side)]] * len(rows),
            "attention_kwargs": {"text_lengths": tuple(r.shape[1] for r in rows)} if lengths else None,
            "return_dict": False,
        }

    report: dict[str, Any] = {
        "meta": {
            "command": "python bench/t2i_kernels.py "
            + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
            "accelerator": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "image_tokens": side * side,
        },
        "results": {"floor": floor(config, side * side, args.prompt_tokens, args.runs), "variants": {}},
    }
    report["results"]["gelu_epilogue"] = gelu_check(config)
    report["results"]["gpu_idle"] = {}
    with gpu_clocks(report["results"]["gpu_idle"]):
        time.sleep(1.0)  # a second of nothing: the idle clock and power to compare with
    if args.sustain:
        chain = sustained(floor_chain(base, image, [text, negative]), args.sustain)
        chain["per_branch_ms"] = round(chain["call_ms_p50"] / 2, 2)
        report["results"]["floor_chain_sustained"] = chain
        print("floor_chain", chain, flush=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    references: dict[int, torch.Tensor] = {}
    torch._dynamo.config.recompile_limit = 64
    has_triton = fused_blocks_module._HAS_TRITON
    for variant in args.variants.split(","):
        parts = set(variant.split("+"))
        model = base if parts == {"eager"} else copy.deepcopy(base)
        if "fuse" in parts:
            fuse_blocks(model)
        fused_blocks_module._HAS_TRITON = has_triton and "notriton" not in parts
        if "cudnn" in parts:
            model.set_attention_backend("_native_cudnn")
        torch._inductor.config.max_autotune = "autotune" in parts
        torch._inductor.config.max_autotune_gemm = "autotune" in parts
        torch._inductor.config.coordinate_descent_tuning = "cdt" in parts
        if "regional" in parts:
            model.compile_repeated_blocks(fullgraph=True, dynamic=None)
        torch._dynamo.reset()
        branches = [text, negative] if "cfg" in parts else [text]
        kwargs = inputs(branches, lengths="fuse" in parts and "cfg" in parts)

        def call(m: Any = model, kw: dict[str, Any] = kwargs) -> torch.Tensor:
            with torch.inference_mode():
                out: torch.Tensor = m(**kw)[0]
            return out

        # ``table``: the calls under one ModulationSchedule whose only timestep is theirs, as a request's steps
        # run (the table built by the first call; every call after it copies its rows).
        schedule = contextlib.ExitStack()
        if "table" in parts:
            timesteps = SimpleNamespace(timesteps=torch.tensor([500.0], device="cuda"))
            schedule.enter_context(ModulationSchedule(SimpleNamespace(transformer=model, scheduler=timesteps)))

        if variant == "eager":  # each branch alone, diffusers as it is: the reference rows
            for i, branch in enumerate([text, negative]):
                references[i] = call(kw=inputs([branch], lengths=False)).float()
        t0 = time.perf_counter()
        first = call()
        torch.cuda.synchronize()
        row: dict[str, Any] = {"first_call_s": round(time.perf_counter() - t0, 1)}
        row["gpu"] = {}
        with gpu_clocks(row["gpu"]):
            row["call_ms_p50"] = round(cuda_ms(call, args.runs, warmup=1), 2)
        row["per_branch_ms"] = round(row["call_ms_p50"] / len(branches), 2)
        row["max_abs_diff_vs_eager"] = [
            round(float((first[i].float() - references[i][0]).abs().max()), 5) for i in range(len(branches))
        ]
        row["output_abs_max"] = round(float(references[0].abs().max()), 4)
        row["kernels"] = kernel_groups(call, 3)
        if args.sustain:
            row["sustained"] = sustained(call, args.sustain)
            row["sustained"]["per_branch_ms"] = round(row["sustained"]["call_ms_p50"] / len(branches), 2)
        if "table" in parts:
            row["table_build_ms"] = table_build_ms(model, kwargs, args.steps)
        schedule.close()
        report["results"]["variants"][variant] = row
        print(variant, row, flush=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        if model is not base:
            del model
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
