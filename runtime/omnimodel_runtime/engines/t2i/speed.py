"""The speed options of the diffusers image engine (``engine_args`` of denoise and whole stages; ``cfg_batch``
also encode, ``vae_2d`` every stage with a VAE). Off by default, so the output is diffusers' own. This module
applies the transformer's (``compile``, ``cache``, ``attention``, ``fuse_blocks``) at load:

- ``compile: regional`` compiles the transformer's repeated block once with ``torch.compile`` and reuses
  it for every block (diffusers' ``compile_repeated_blocks``): CUDA kernels fused, far fewer launches.
  Pixels then differ from the eager pipeline's by the compiled kernels' rounding.
- ``cache: taylorseer`` (``cache_interval``, default 3; ``cache_warmup``, default 3) turns on diffusers'
  TaylorSeer cache: after the first ``cache_warmup`` steps, only every ``cache_interval``-th step computes
  the cached modules; the steps between predict each one's output from its last ones (first-order Taylor
  expansion in the step). ``cache_scope: attention`` (default, diffusers' own choice) caches the blocks'
  attention modules (the rest of each block still runs every step); ``cache_scope: blocks`` caches whole
  repeated transformer blocks, so a predicted step runs none of them. A fixed schedule, so it skips the
  same work whatever the weights, at a quality cost the benchmark states (pixel difference from the exact
  path on the same seed). With ``compile: regional`` it needs ``cache_scope: blocks``: the compiled code is
  then the blocks' own forward, which the cache hooks wrap (a hook inside a compiled block would break
  its graph); without a cache, ``compile: regional`` compiles the blocks' module call.
  ``cache: first_block`` (``cache_threshold``, default 0.08) is diffusers' First-Block Cache instead:
  it skips the remaining blocks of a step whose first block's output barely changed (adaptive; with
  random weights it rarely triggers).
- ``attention: cudnn`` (or ``flash``, ``efficient``; default ``native``) pins the transformer's attention to
  one of PyTorch's scaled-dot-product kernels (diffusers' ``set_attention_backend``: ``_native_cudnn``,
  ``_native_flash``, ``_native_efficient``) instead of letting PyTorch pick per call (its flash kernel
  takes no mask, so ``cfg_batch`` with prompts of different lengths gets another one). A kernel that
  cannot serve a call fails it; bench/t2i_speed.py measures what each one buys.
- ``fuse_blocks: true`` (Qwen-Image) runs the transformer blocks through
  :mod:`~omnimodel_runtime.engines.t2i.fused`: the rotary embedding in real arithmetic (inductor fuses it;
  diffusers' complex form falls back to eager kernels), the MLP's GELU in the matrix product's epilogue,
  with ``cfg_batch`` each guidance branch attending unmasked over its own prompt length, and every step's
  modulation rows computed once a request (the timesteps are the scheduler's), and on CUDA with Triton the
  query/key norms and rotations as one kernel a block (:mod:`~omnimodel_runtime.engines.t2i.kernels`). The
  same arithmetic, other rounding (the GELU acts on the fp32 accumulator); the benchmark states the difference.
- ``cfg_batch: true`` (Qwen-Image, Qwen-Image-Edit) runs true classifier-free guidance as one transformer
  call per step on ``[positive; negative]`` instead of the pipeline's two
  (:mod:`~omnimodel_runtime.engines.t2i.guidance`); the guidance combination stays the pipeline's. In the
  encode (or whole) stage it encodes the prompt and the negative prompt in one text-encoder pass (the
  family's ``encode_together``; Qwen-Image-Edit encodes them one at a time, each with the input image's
  tokens). Off by default: with prompts of different lengths the batched calls attend through a padding
  mask, and the pixels then differ from diffusers' by rounding (bench/t2i_speed.py measures how much); off,
  they are diffusers' own, which tests and the benchmark check.
- ``vae_2d: true`` (Qwen-Image's VAE, built on diffusers' causal 3D convolutions) runs each of the
  VAE's convolutions on a single frame (an image) as the 2D convolution of its last time tap
  (:mod:`~omnimodel_runtime.engines.t2i.vae`): the taps it skips meet only zero padding. Other rounding.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Final

import torch

from omnimodel_runtime.engines.base import flag
from omnimodel_runtime.pipeline import Stage

log = logging.getLogger(__name__)

# Graphs dynamo may keep for the compiled block (shape families: size x batch x prompt length at worst).
RECOMPILE_LIMIT: Final = 64
# engine_args.attention -> diffusers' attention backend (PyTorch's scaled-dot-product kernels, pinned).
ATTENTION_BACKENDS: Final = {"cudnn": "_native_cudnn", "flash": "_native_flash", "efficient": "_native_efficient"}


def repeated_blocks(transformer: Any) -> list[tuple[str, Any]]:
    """The transformer's repeated blocks (diffusers' ``_repeated_blocks`` class names), with their module
    names: what ``compile: regional`` compiles and ``cache_scope: blocks`` caches."""
    names = set(getattr(transformer, "_repeated_blocks", None) or ())
    found = [(name, module) for name, module in transformer.named_modules() if type(module).__name__ in names]
    if not found:
        raise ValueError(f"{type(transformer).__name__} names no repeated blocks to compile or cache")
    return found


def speed_up(pipe: Any, stage: Stage) -> None:
    """The ``compile``, ``cache``, ``attention`` and ``fuse_blocks`` engine arguments of ``stage`` on the
    loaded pipeline's transformer (nothing for a stage loaded without one)."""
    args = stage.engine_args
    transformer = getattr(pipe, "transformer", None)
    if transformer is None:
        return
    cache = args.get("cache")
    scope = args.get("cache_scope") or "attention"
    mode = args.get("compile")
    attention = args.get("attention")
    if cache not in (None, "", "none", "taylorseer", "first_block"):
        raise ValueError(f"engine_args.cache must be taylorseer, first_block or none, not {cache!r}")
    if scope not in ("attention", "blocks"):
        raise ValueError(f"engine_args.cache_scope must be attention or blocks, not {scope!r}")
    if mode not in (None, "", "none", "regional"):
        raise ValueError(f"engine_args.compile must be regional or none, not {mode!r}")
    if attention not in (None, "", "native") and attention not in ATTENTION_BACKENDS:
        raise ValueError(
            f"engine_args.attention must be one of native, {', '.join(ATTENTION_BACKENDS)}, not {attention!r}"
        )
    compiled = mode == "regional"
    if compiled and cache == "taylorseer" and scope != "blocks":
        raise ValueError(
            "engine_args.compile: regional with cache: taylorseer needs engine_args.cache_scope: blocks "
            "(attention-scoped cache hooks sit inside the compiled blocks)"
        )
    if compiled and cache == "first_block":
        raise ValueError("engine_args.compile: regional does not combine with cache: first_block")
    if attention not in (None, "", "native"):
        transformer.set_attention_backend(ATTENTION_BACKENDS[attention])
    fuse = flag(args, "fuse_blocks", default=False)
    if fuse:
        from omnimodel_runtime.engines.t2i.fused import fuse_blocks  # noqa: PLC0415

        fuse_blocks(transformer)  # before the compile below: the compiled code is the fused blocks'
    block_cache = cache == "taylorseer" and scope == "blocks"
    blocks = repeated_blocks(transformer) if block_cache else []
    if compiled:
        # Shapes vary by request: the prompt's token count, the batch, the image size. dynamic=None lets
        # dynamo compile a shape-generic graph when a dimension changes (a second prompt length, say)
        # instead of one graph per shape; with dynamic=False every new prompt length cost a compile and
        # the ninth failed the request (fullgraph: FailOnRecompileLimitHit, seen on the H200).
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        if block_cache:
            # The block's own forward, not the module call: the cache hooks installed below replace
            # ``forward`` and call this compiled one on the steps they compute. The blocks share one
            # code object, so dynamo compiles it once for all of them.
            for _, block in blocks:
                block.forward = torch.compile(block.forward, fullgraph=True, dynamic=None)
        else:
            transformer.compile_repeated_blocks(fullgraph=True, dynamic=None)
    if cache not in (None, "", "none"):
        import diffusers  # noqa: PLC0415

        if cache == "taylorseer":
            config = diffusers.TaylorSeerCacheConfig(
                cache_interval=int(args.get("cache_interval", 3)),
                disable_cache_before_step=int(args.get("cache_warmup", 3)),
                max_order=1,
                taylor_factors_dtype=torch.float32,
                cache_identifiers=[re.escape(name) for name, _ in blocks] if block_cache else None,
            )
        else:
            config = diffusers.FirstBlockCacheConfig(threshold=float(args.get("cache_threshold", 0.08)))
        transformer.enable_cache(config)
    if fuse or any(value not in (None, "", "none", "native") for value in (cache, mode, attention)):
        log.info(
            "Transformer of stage %s: compile=%s cache=%s (%s) attention=%s fuse_blocks=%s",
            stage.name,
            mode,
            cache,
            scope,
            attention,
            fuse,
        )
