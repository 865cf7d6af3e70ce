"""Batched decode steps of Qwen3-Omni's decoders (thinker, talker) over request slots.

:class:`~omnimodel_runtime.engines.slots.SlotDecoder` runs a Qwen2-style layer; Qwen3's attention adds an
RMSNorm over each head's query and key (``q_norm``, ``k_norm``) between the projections and the rotary
embedding, which :class:`Qwen3SlotDecoder` puts into that step (compiled and captured the same way). Its
mixture-of-experts MLPs run as the module they are: through grouped products (``engine_args.moe``,
:mod:`..moe`, no host synchronisation, so a step can be a CUDA graph) or transformers' loop over experts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from omnimodel_runtime.engines.slots import SlotDecoder, _rotate_half


class Qwen3SlotDecoder(SlotDecoder):
    """A :class:`SlotDecoder` with Qwen3's per-head query/key norms.

    ``hidden``: whether :meth:`step` returns the final-normed hidden states. The Qwen2.5 thinker engine's
    batched step sends each row's ``hidden + embedding`` to the talker; Qwen3's talker reads a reply token's
    input embedding alone, so the Qwen3 thinker's decoder returns zeros there (``0 + e`` is ``e`` exactly).
    """

    def __init__(self, body: Any, head: Any, *, hidden: bool = True, **kwargs: Any) -> None:
        super().__init__(body, head, **kwargs)
        self._zeros = None if hidden else torch.zeros_like(self._embeds)

    def _head_norm(self, norm: Any, x: torch.Tensor) -> torch.Tensor:
        if hasattr(norm, "variance_epsilon") and hasattr(norm, "weight"):
            return self._rms(norm, x)
        out: torch.Tensor = norm(x)
        return out

    def _project(
        self, layer: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        attn = layer.self_attn
        h = self._rms(layer.input_layernorm, x)
        q = self._head_norm(attn.q_norm, attn.q_proj(h).view(rows, heads, dim))
        k = self._head_norm(attn.k_norm, attn.k_proj(h).view(rows, kv_heads, dim))
        v = attn.v_proj(h).view(rows, kv_heads, dim)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return q, k, v

    def step(
        self, embeds: torch.Tensor, index: Sequence[int], rope: Sequence[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, logits = super().step(embeds, index, rope)
        if self._zeros is not None:
            hidden = self._zeros[: len(index)]
        return hidden, logits
