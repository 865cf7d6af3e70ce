"""Mixture-of-experts MLPs (Qwen3-Omni's thinker and talker) through grouped matrix products.

transformers' eager experts forward loops over the experts a batch hit in Python: it asks the device which
experts were hit (a host synchronisation, so no CUDA graph can hold it) and then launches four or five
small kernels per expert, up to 128 experts a layer. :func:`grouped_forward` does the same arithmetic as
one sort and two grouped products:

- the ``tokens × top_k`` picks are sorted by expert (stable, so each expert's rows keep token order and
  each token's contributions are added in ascending expert order, as the loop adds them);
- ``gate_up`` and ``down`` are each one grouped product over those rows
  (``torch.nn.functional.grouped_mm``, else ``torch._grouped_mm``, with the groups' end offsets computed
  on the device); where neither exists or the shapes do not meet its 16-byte alignment, a batched
  product over the groups padded to the batch's token count (every token picks an expert at most once),
  and beyond a size where that padding would cost more than it saves, the model's own loop;
- each row is scaled by its routing weight and added back to its token.

No step reads a value on the host, so a decode step with these MLPs can be captured as a CUDA graph.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, Final

import torch

log = logging.getLogger(__name__)

# The padded fallback's largest buffer (experts × tokens × width values); beyond it the model's loop.
PADDED_LIMIT: Final = 1 << 26


def _grouped_mm() -> Callable[..., torch.Tensor] | None:
    fn: Callable[..., torch.Tensor] | None = getattr(torch.nn.functional, "grouped_mm", None) or getattr(
        torch, "_grouped_mm", None
    )
    return fn


def _aligned(*tensors: torch.Tensor) -> bool:
    """Whether every row of ``tensors`` meets the grouped product's 16-byte stride rule."""
    return all(t.shape[-1] * t.element_size() % 16 == 0 for t in tensors)


def is_experts(module: Any) -> bool:
    """Whether ``module`` is a fused-experts module of the kind :func:`grouped_forward` runs: 3-D
    ``gate_up_proj`` (experts, 2·intermediate, hidden) and ``down_proj`` (experts, hidden, intermediate)."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (
        isinstance(gate_up, torch.Tensor)
        and isinstance(down, torch.Tensor)
        and gate_up.ndim == 3
        and down.ndim == 3
        and hasattr(module, "act_fn")
        and not getattr(module, "has_bias", False)
    )


def grouped_forward(
    experts: Any, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """``experts(hidden, top_k_index, top_k_weights)`` as transformers' eager loop computes it: for each
    token, the sum over its picks of ``weight · down(act(gate) · up)``. ``hidden`` (tokens, width),
    ``top_k_index``/``top_k_weights`` (tokens, k). An index equal to the expert count (the loop's
    "no expert" sentinel) contributes nothing."""
    gate_up: torch.Tensor = experts.gate_up_proj
    down: torch.Tensor = experts.down_proj
    count = gate_up.shape[0]
    tokens, k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    picked = flat[order]
    token = order // k
    rows = hidden[token]
    weights = top_k_weights.reshape(-1)[order]
    sizes = torch.zeros(count + 1, dtype=torch.int32, device=hidden.device)
    sizes.scatter_add_(0, picked, torch.ones_like(picked, dtype=torch.int32))
    ends = torch.cumsum(sizes[:count], 0, dtype=torch.int32)
    w_gate_up, w_down = gate_up.transpose(-2, -1), down.transpose(-2, -1)  # (experts, in, out)
    mm = _grouped_mm()
    if mm is not None and _aligned(rows, gate_up, down) and rows.dtype == gate_up.dtype:
        gate, up = mm(rows, w_gate_up, offs=ends).chunk(2, dim=-1)
        out = mm(experts.act_fn(gate) * up, w_down, offs=ends)
    elif count * tokens * max(hidden.shape[-1], gate_up.shape[1]) <= PADDED_LIMIT:
        out = _padded(experts, rows, picked, ends, tokens)
    else:
        loop: torch.Tensor = experts._loop_forward(hidden, top_k_index, top_k_weights)
        return loop
    # Rows past the last group (the sentinel's) are not computed by the grouped product: zero them.
    out = torch.where((picked < count).unsqueeze(-1), out * weights.unsqueeze(-1).to(out.dtype), 0)
    return torch.zeros_like(hidden).index_add_(0, token, out.to(hidden.dtype))


def _padded(experts: Any, rows: torch.Tensor, picked: torch.Tensor, ends: torch.Tensor, tokens: int) -> torch.Tensor:
    """The grouped products as two batched products over (experts, tokens, ·) buffers, each expert's rows
    at the top of its slab (a token picks an expert at most once: ``tokens`` rows are enough)."""
    gate_up: torch.Tensor = experts.gate_up_proj
    down: torch.Tensor = experts.down_proj
    count = gate_up.shape[0]
    starts = torch.cat((ends.new_zeros(1), ends[:-1]))
    valid = picked < count
    expert = picked.clamp_max(count - 1)
    slot = torch.arange(picked.shape[0], device=rows.device) - starts[expert].long()
    slab = rows.new_zeros((count, tokens, rows.shape[-1]))
    slab[expert[valid], slot[valid]] = rows[valid]
    gate, up = torch.bmm(slab, gate_up.transpose(-2, -1)).chunk(2, dim=-1)
    out = torch.bmm(experts.act_fn(gate) * up, down.transpose(-2, -1))
    return out[expert, slot.clamp_min(0)]


def use_grouped_experts(model: Any) -> int:
    """Run every fused-experts module of ``model`` through :func:`grouped_forward` (its own forward stays
    reachable as ``_loop_forward``); returns how many there were."""
    count = 0
    for module in model.modules():
        if is_experts(module) and not hasattr(module, "_loop_forward"):
            module._loop_forward = module.forward
            module.forward = functools.partial(grouped_forward, module)
            count += 1
    return count
