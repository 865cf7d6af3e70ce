"""Qwen3-Omni's mixture-of-experts MLPs through grouped products (engines/omni/moe.py) against transformers'
own loop over experts, on CPU in float32 (within its rounding: the products sum in another order): the
grouped product, its padded fallback, the "no expert" sentinel, and the whole sparse block of the thinker
and the talker."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
    Qwen3OmniMoeTalkerTextConfig,
    Qwen3OmniMoeTextConfig,
)
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeTalkerTextSparseMoeBlock,
    Qwen3OmniMoeThinkerTextSparseMoeBlock,
)

from omnimodel_runtime.engines.omni import moe

EXPERTS = 16


def _block(cls: Any, config: Any, seed: int) -> Any:
    torch.manual_seed(seed)
    block = cls(config).eval()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return block


def thinker_block(hidden: int = 64, intermediate: int = 32) -> Any:
    config = Qwen3OmniMoeTextConfig(
        hidden_size=hidden, moe_intermediate_size=intermediate, num_experts=EXPERTS, num_experts_per_tok=4
    )
    return _block(Qwen3OmniMoeThinkerTextSparseMoeBlock, config, 0)


def routing(tokens: int, k: int = 4, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(EXPERTS, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand((tokens, k), generator=g)
    return index, weights / weights.sum(-1, keepdim=True)


@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_the_grouped_product_gives_the_loops_answer(tokens: int) -> None:
    experts = thinker_block().experts
    hidden = torch.randn(tokens, 64)
    index, weights = routing(tokens)
    with torch.inference_mode():
        loop = experts(hidden, index, weights)
        grouped = moe.grouped_forward(experts, hidden, index, weights)
    torch.testing.assert_close(grouped, loop, rtol=1e-5, atol=1e-5)


def test_the_padded_fallback_gives_the_loops_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(moe, "_grouped_mm", lambda: None)
    experts = thinker_block().experts
    hidden = torch.randn(9, 64)
    index, weights = routing(9)
    with torch.inference_mode():
        torch.testing.assert_close(
            moe.grouped_forward(experts, hidden, index, weights), experts(hidden, index, weights), rtol=1e-5, atol=1e-5
        )


def test_unaligned_widths_take_the_padded_path_and_agree() -> None:
    # 12 float32 values a row: not a multiple of 16 bytes, which the grouped product refuses.
    experts = thinker_block(hidden=12, intermediate=6).experts
    hidden = torch.randn(7, 12)
    index, weights = routing(7)
    with torch.inference_mode():
        torch.testing.assert_close(
            moe.grouped_forward(experts, hidden, index, weights), experts(hidden, index, weights), rtol=1e-5, atol=1e-5
        )


def test_the_no_expert_sentinel_contributes_nothing() -> None:
    experts = thinker_block().experts
    hidden = torch.randn(6, 64)
    index, weights = routing(6)
    index[::2, 0] = EXPERTS  # the loop's one-hot has a column for it and skips it
    with torch.inference_mode():
        torch.testing.assert_close(
            moe.grouped_forward(experts, hidden, index, weights), experts(hidden, index, weights), rtol=1e-5, atol=1e-5
        )


def test_sparse_blocks_of_thinker_and_talker_run_grouped_and_agree_with_their_loops() -> None:
    talker_config = Qwen3OmniMoeTalkerTextConfig(
        hidden_size=32,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=64,
        num_experts=EXPERTS,
        num_experts_per_tok=2,
    )
    for block, width in ((thinker_block(), 64), (_block(Qwen3OmniMoeTalkerTextSparseMoeBlock, talker_config, 2), 32)):
        x = torch.randn(2, 5, width)
        with torch.inference_mode():
            loop = block(x)
            assert moe.use_grouped_experts(block) == 1
            assert moe.use_grouped_experts(block) == 0  # installed once
            assert block.experts.forward.func is moe.grouped_forward
            grouped = block(x)
        torch.testing.assert_close(grouped, loop, rtol=1e-5, atol=1e-5)
