"""Device helpers of the engines: the attention kernels a stage's generate() calls may use."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.nn.attention import SDPBackend

from omnimodel_runtime.engines.devices import sdpa_backends, sdpa_scope
from omnimodel_runtime.engines.omni.engine import PREFILL_ATTENTION_CUDA


def test_attention_kernels_are_named_in_a_list() -> None:
    assert sdpa_backends(None) is None
    assert sdpa_backends("auto") is None
    assert sdpa_backends("flash+math") == [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
    assert sdpa_backends(PREFILL_ATTENTION_CUDA) == [
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.MATH,
    ]
    assert SDPBackend.CUDNN_ATTENTION not in sdpa_backends(PREFILL_ATTENTION_CUDA)


def test_an_unknown_kernel_is_refused_by_the_argument_s_name() -> None:
    with pytest.raises(ValueError, match=r"engine_args.prefill_attention: unknown attention kernel\(s\) \['fast'\]"):
        sdpa_backends("flash,fast", "engine_args.prefill_attention")


def test_the_scope_restricts_attention_to_its_kernels_and_then_lets_go() -> None:
    q = torch.randn(1, 2, 5, 8)
    with sdpa_scope(None):
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    with sdpa_scope(sdpa_backends("math")):
        assert torch.backends.cuda.math_sdp_enabled()
        assert not torch.backends.cuda.flash_sdp_enabled()
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    # The CPU has no cuDNN kernel: restricted to it, attention has nothing to run.
    with sdpa_scope(sdpa_backends("cudnn")), pytest.raises(RuntimeError, match="No viable backend"):
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert torch.backends.cuda.flash_sdp_enabled()


def test_overlapping_scopes_of_two_threads_restore_the_switches_when_the_last_one_leaves() -> None:
    """The thinker's and the talker's workers prefill at once: torch's switches are process-wide, so
    the first scope to leave must not restore them under the other, nor the last leave them restricted."""
    restricted = sdpa_backends("math")
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    during: list[bool] = []

    def a() -> None:
        with sdpa_scope(restricted):
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def b() -> None:
        a_in.wait(10)
        with sdpa_scope(restricted):
            b_in.set()
            a_out.wait(10)
            during.append(torch.backends.cuda.flash_sdp_enabled())

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert during == [False]  # still restricted after the other thread's scope ended
    assert torch.backends.cuda.flash_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled()
