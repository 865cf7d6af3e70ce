"""The batched talker's draw: ``torch.multinomial``'s numbers without its device read-back."""

from __future__ import annotations

import torch

from omnimodel_runtime.engines.omni.talker import draw


def test_each_row_draws_what_multinomial_draws_from_its_generator_and_keeps_the_state_before() -> None:
    probs = torch.softmax(torch.randn(3, 8296, generator=torch.Generator().manual_seed(1)) * 3, dim=-1)
    ours = [torch.Generator().manual_seed(seed) for seed in (5, 6, 7)]
    theirs = [torch.Generator().manual_seed(seed) for seed in (5, 6, 7)]
    for _ in range(50):
        starts = [gen.get_state() for gen in theirs]
        picks, before = draw(probs, ours)
        expected = [int(torch.multinomial(probs[k : k + 1], 1, generator=gen)) for k, gen in enumerate(theirs)]
        assert picks.tolist() == expected
        assert all(torch.equal(a, b) for a, b in zip(before, starts, strict=True))
    assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(ours, theirs, strict=True))
