"""Sampling in the transformers text engine: every temperature and top_p the API accepts draws a token."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from omnimodel_runtime.engines.text.transformers import TransformersTextEngine


def row(temperature: float, top_p: float, seed: int = 0) -> SimpleNamespace:
    sampling = SimpleNamespace(greedy=False, temperature=temperature, top_p=top_p)
    return SimpleNamespace(sampling=sampling, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("temperature", [5e-324, 1e-30, 0.5, 2.0])
@pytest.mark.parametrize("top_p", [5e-324, 0.5, 1.0])
def test_any_accepted_temperature_and_top_p_draws_a_token(temperature: float, top_p: float) -> None:
    logits = torch.tensor([[1.0, 30.0, -2.0, 29.5], [0.0, 0.0, 0.0, 0.0]])
    tokens = TransformersTextEngine._sample(None, logits, [row(temperature, top_p), row(temperature, top_p, 1)])  # type: ignore[arg-type]
    assert len(tokens) == 2 and all(0 <= t < 4 for t in tokens)
    if temperature < 1e-20 or top_p < 1e-20:
        assert tokens[0] == 1  # as good as greedy: the best token only
