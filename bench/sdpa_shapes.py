"""What a prompt length the process has not seen costs each scaled-dot-product attention kernel.

The omni stages' prefills go through Hugging Face ``generate()``, whose attention calls
``torch.nn.functional.scaled_dot_product_attention`` on ``[1, heads, L, head_dim]`` with ``is_causal`` and
grouped key/value heads (``enable_gqa``, as transformers passes them when there is no mask). A kernel that
builds something per shape (cuDNN's attention builds an execution plan for each new one) pays for it on
every new prompt length. For each kernel and each attention geometry this times the first call at lengths
no kernel has seen before, and the same call again, synchronised, and writes JSON.

    python bench/sdpa_shapes.py --out sdpa.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from omnimodel_runtime.engines.devices import sdpa_backends
from omnimodel_runtime.engines.omni.engine import PREFILL_ATTENTION_CUDA

# Qwen2.5-Omni-7B: the thinker's text model and the talker (heads, key/value heads, head_dim).
GEOMETRIES = {"thinker": (28, 4, 128), "talker": (12, 4, 128)}
# Labels (as in the committed JSON) -> engine_args.prefill_attention values: torch's choice, each kernel
# alone, and the stages' default on CUDA.
KERNELS = {
    label: sdpa_backends(spec)
    for label, spec in {
        "default": "auto",
        "cudnn": "cudnn",
        "flash": "flash",
        "efficient": "efficient",
        "flash+efficient+math": PREFILL_ATTENTION_CUDA,
    }.items()
}


def call(heads: int, kv: int, dim: int, length: int, kernels: list[SDPBackend] | None) -> tuple[float, float]:
    """(first call, median of 5 more) in ms for one new ``length``."""
    q = torch.randn(1, heads, length, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, kv, length, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)

    def once() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if kernels is None:
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            with sdpa_kernel(kernels):
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1000

    first = once()
    return first, statistics.median(once() for _ in range(5))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--lengths", type=int, default=6, help="new lengths per kernel and geometry")
    args = parser.parse_args()
    # Warm the CUDA context and the library handles on a length no timed call uses.
    for kernels in KERNELS.values():
        with contextlib.suppress(RuntimeError):  # a kernel that refuses the call is reported below
            call(28, 4, 128, 16, kernels)
    results: dict[str, dict[str, object]] = {}
    length = 101  # every timed call gets a length nothing has run at before (lengths as prompts bring them)
    for geometry, (heads, kv, dim) in GEOMETRIES.items():
        for name, kernels in KERNELS.items():
            firsts, agains, error = [], [], None
            for _ in range(args.lengths):
                length += 7
                try:
                    first, again = call(heads, kv, dim, length, kernels)
                except RuntimeError as err:
                    error = str(err).splitlines()[0][:200]
                    break
                firsts.append(round(first, 3))
                agains.append(round(again, 3))
            results[f"{geometry}/{name}"] = {
                "first_ms": firsts,
                "again_ms": agains,
                "first_p50_ms": statistics.median(firsts) if firsts else None,
                "again_p50_ms": statistics.median(agains) if agains else None,
                "error": error,
            }
    out = {
        "meta": {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "geometries": GEOMETRIES},
        "results": results,
    }
    args.out.write_text(json.dumps(out, indent=1))
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
