"""``fuse_blocks`` (engine arg, Qwen-Image): the transformer blocks' work in fewer GPU passes, the same
arithmetic. Where a 1024² call's 135 ms went under ``compile: regional`` (bench/t2i_kernels.py on the H200,
bench/results/t2i-qwen-image-kernels-1024-h200.json): matrix products 91 ms, attention 29 ms, fused
elementwise kernels 13 ms, eager fallbacks 5 ms. Three changes, each removing a pass over the activations or
a read of the weights:

- **RoPE in real arithmetic** (:func:`rotate`). diffusers rotates queries and keys as complex numbers;
  inductor generates no code for complex tensors, so under ``torch.compile`` each complex op ran as its own
  eager kernel over the activations. In real form (the same fp32 products and sums) it fuses into the RMS
  norm kernel before it. The transformer's rotary table is handed to the blocks as ``view_as_real`` pairs.
- **GELU in the matrix product's epilogue** (:func:`linear_gelu`): the MLP's up-projection and its tanh
  GELU as one cuBLASLt call (``torch._addmm_activation``), instead of the product writing 4096 x 12288
  values and a second kernel reading them back. An opaque custom op, so inductor keeps the fused call. The
  GELU then acts on the fp32 accumulator rather than its bf16 rounding: a rounding difference.
- **Guidance branches attend over their own prompt lengths.** With ``cfg_batch`` the positive and
  negative prompts are right-padded to one length and diffusers masks the padding, which takes PyTorch off
  its fastest attention kernel (cuDNN's, which it picks for unmasked calls: 84 ms of attention a batched
  1024² call masked, 57 ms split as below, 29 ms a branch alone). Given the
  branches' lengths (``attention_kwargs['text_lengths']``, which the Qwen-Image family passes when it pads
  unmasked prompts), each sample attends unmasked over its real text tokens and the image: for every real
  token the same attention as the branch's own call; padded text positions get zeros, and nothing reads
  them. The batched call then reads the blocks' weights once for both branches, which at 1024² is what
  batching buys (the modulation and text-stream products are weight reads of one or a few rows).

Off by default: diffusers' own blocks stay the reference, and tests check ``fuse_blocks`` against them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from diffusers.models.activations import GELU
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0

from omnimodel_runtime.engines.t2i.guidance import TAKES_TEXT_LENGTHS


def rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """diffusers' ``apply_rotary_emb_qwen(x, freqs, use_real=False)`` in real arithmetic: x's channel pairs
    ``(a, b)`` as ``a + ib`` times ``freqs`` (``[S, D/2]`` complex, or its ``view_as_real`` ``[S, D/2, 2]``),
    back to pairs: the same fp32 products and sums."""
    f = (torch.view_as_real(freqs) if freqs.is_complex() else freqs)[:, None]  # [S, 1, D/2, 2]
    cos, sin = f[..., 0], f[..., 1]
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(3).type_as(x)


@torch.library.custom_op("omnimodel::linear_gelu", mutates_args=())
def linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``gelu(x @ weight.T + bias, approximate='tanh')`` as one call: on CUDA cuBLASLt's GELU-bias epilogue
    (``_addmm_activation``, whose CUDA GELU is the tanh one; bench/t2i_kernels.py checks it against the
    pair), elsewhere the unfused pair (on CPU ``_addmm_activation`` applies the exact, erf GELU)."""
    if x.device.type != "cuda":
        return torch.nn.functional.gelu(torch.nn.functional.linear(x, weight, bias), approximate="tanh")
    flat = x.reshape(-1, x.shape[-1])
    out = torch._addmm_activation(bias, flat, weight.t(), use_gelu=True)
    return out.reshape(*x.shape[:-1], weight.shape[0])


@linear_gelu.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _gelu_forward(module: GELU) -> Any:
    proj = module.proj

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = linear_gelu(hidden_states, proj.weight, proj.bias)
        return out

    return forward


class FusedDoubleStreamProcessor(QwenDoubleStreamAttnProcessor2_0):  # type: ignore[misc]
    """Qwen-Image's joint attention (diffusers' ``QwenDoubleStreamAttnProcessor2_0``) with the rotation in
    real arithmetic and per-sample prompt lengths (module docstring)."""

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_hidden_states_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        text_lengths: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if encoder_hidden_states is None:
            raise ValueError("the joint attention needs encoder_hidden_states (the text stream)")
        if attention_mask is not None:
            raise ValueError("the joint attention builds its mask from encoder_hidden_states_mask")
        batch, seq_txt = encoder_hidden_states.shape[:2]
        split = text_lengths is not None and len(text_lengths) == batch
        if encoder_hidden_states_mask is not None and not split:
            image_mask = torch.ones(hidden_states.shape[:2], dtype=torch.bool, device=hidden_states.device)
            attention_mask = torch.cat([encoder_hidden_states_mask, image_mask], dim=1)[:, None, None, :]
        head_dim = attn.inner_dim // attn.heads
        img = [p(hidden_states).unflatten(-1, (-1, head_dim)) for p in (attn.to_q, attn.to_k, attn.to_v)]
        txt = [
            p(encoder_hidden_states).unflatten(-1, (-1, head_dim))
            for p in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
        ]
        img[0], img[1] = attn.norm_q(img[0]), attn.norm_k(img[1])
        txt[0], txt[1] = attn.norm_added_q(txt[0]), attn.norm_added_k(txt[1])
        if image_rotary_emb is not None:
            img_freqs, txt_freqs = image_rotary_emb
            img[0], img[1] = (rotate(t, img_freqs) for t in img[:2])
            txt[0], txt[1] = (rotate(t, txt_freqs) for t in txt[:2])

        def attend(t: list[torch.Tensor], i: list[torch.Tensor], mask: torch.Tensor | None) -> torch.Tensor:
            # [text, image], the order diffusers' processor attends in.
            query, key, value = (torch.cat([a, b], dim=1) for a, b in zip(t, i, strict=True))
            out: torch.Tensor = dispatch_attention_fn(
                query,
                key,
                value,
                attn_mask=mask,
                dropout_p=0.0,
                is_causal=False,
                backend=self._attention_backend,
                parallel_config=self._parallel_config,
            )
            return out

        if split:
            assert text_lengths is not None
            rows = []
            for b, n in enumerate(text_lengths):
                out = attend([t[b : b + 1, :n] for t in txt], [t[b : b + 1] for t in img], None)
                if n < seq_txt:
                    out = torch.cat([out[:, :n], out.new_zeros(1, seq_txt - n, *out.shape[2:]), out[:, n:]], dim=1)
                rows.append(out)
            joint = torch.cat(rows)
        else:
            joint = attend(txt, img, attention_mask)
        joint = joint.flatten(2, 3).to(img[0].dtype)
        img_out = attn.to_out[0](joint[:, seq_txt:, :].contiguous())
        if len(attn.to_out) > 1:
            img_out = attn.to_out[1](img_out)
        return img_out, attn.to_add_out(joint[:, :seq_txt, :].contiguous())


def _real_rope(forward: Any) -> Any:
    """The transformer's rotary table as ``view_as_real`` pairs, so the compiled blocks get no complex input."""

    def real(*args: Any, **kwargs: Any) -> Any:
        return tuple(torch.view_as_real(f) if f.is_complex() else f for f in forward(*args, **kwargs))

    real.__wrapped__ = forward  # type: ignore[attr-defined]
    return real


def fuse_blocks(transformer: Any) -> int:
    """Install the module docstring's changes in place (before any compile); returns how many blocks.
    Raises ``ValueError`` for a transformer whose blocks are not Qwen-Image's double-stream ones."""
    fused = 0
    for block in getattr(transformer, "transformer_blocks", []):
        attn = getattr(block, "attn", None)
        if attn is None or not isinstance(attn.processor, QwenDoubleStreamAttnProcessor2_0):
            continue
        if not isinstance(attn.processor, FusedDoubleStreamProcessor):
            backend = attn.processor._attention_backend
            attn.set_processor(FusedDoubleStreamProcessor())
            attn.processor._attention_backend = backend
        for mlp in (block.img_mlp, block.txt_mlp):
            first = mlp.net[0]
            if isinstance(first, GELU) and first.approximate == "tanh" and first.proj.bias is not None:
                first.forward = _gelu_forward(first)
        fused += 1
    if not fused:
        name = type(transformer).__name__
        raise ValueError(f"engine_args.fuse_blocks: {name} has no Qwen-Image double-stream blocks")
    pos_embed = transformer.pos_embed
    if not hasattr(pos_embed.forward, "__wrapped__"):
        pos_embed.forward = _real_rope(pos_embed.forward)
    setattr(transformer, TAKES_TEXT_LENGTHS, True)
    return fused


def unfuse_blocks(transformer: Any) -> None:
    """Undo :func:`fuse_blocks` (diffusers' processor and GELU again); benchmarks compare both on one model."""
    for block in getattr(transformer, "transformer_blocks", []):
        attn = getattr(block, "attn", None)
        if attn is not None and isinstance(attn.processor, FusedDoubleStreamProcessor):
            backend = attn.processor._attention_backend
            attn.set_processor(QwenDoubleStreamAttnProcessor2_0())
            attn.processor._attention_backend = backend
        for mlp in (block.img_mlp, block.txt_mlp):
            vars(mlp.net[0]).pop("forward", None)
    wrapped = getattr(transformer.pos_embed.forward, "__wrapped__", None)
    if wrapped is not None:
        transformer.pos_embed.forward = wrapped
    vars(transformer).pop(TAKES_TEXT_LENGTHS, None)
