"""The one hand-written GPU kernel of ``fuse_blocks``: Qwen-Image's query/key RMS norm and rotary embedding,
written straight into the joint ``[image; text]`` tensor the attention reads (engines/t2i/fused.py).

Under ``compile: regional`` inductor generated this as a loop reduction that reads each row twice and a
copy of its result into the concatenation (bench/README.md has the profile: 11 ms and 4 ms of a 1024²
call). Here a program takes ``BLOCK_T`` tokens of one head: loads them once, norms each ``HEAD_DIM`` row,
rotates its channel pairs, stores into its rows of the joint tensor. The arithmetic is diffusers':
``RMSNorm`` (fp32 variance, the product rounded to the weight's dtype before the weight multiplies, when
that is half precision) then ``apply_rotary_emb_qwen`` in fp32. Runs on CUDA (CPU tests run it under
Triton's interpreter); imported lazily.
"""

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton
from triton.runtime.jit import JITFunction

BLOCK_T = 32


# No annotations on the arguments but the constexpr ones: the GPU compiler resolves each annotation as a global
# of this module (``Any`` failed to compile there; the interpreter ignores them).
@triton.jit  # type: ignore[untyped-decorator]
def _norm_rope(  # type: ignore[no-untyped-def]
    x_ptr,
    w_ptr,
    f_ptr,
    out_ptr,
    seq,
    x_stride_b,
    x_stride_s,
    out_stride_b,
    out_stride_s,
    out_offset,
    eps,
    HEAD_DIM: tl.constexpr,  # noqa: N803 - Triton spells its compile-time constants in capitals
    BLOCK_T: tl.constexpr,  # noqa: N803
    ROUND: tl.constexpr,  # noqa: N803
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1)
    batch = tl.program_id(2)
    dims = tl.arange(0, HEAD_DIM)
    valid = (tokens < seq)[:, None]
    rows = batch * x_stride_b + tokens[:, None] * x_stride_s + head * HEAD_DIM + dims[None, :]
    x = tl.load(x_ptr + rows, mask=valid, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
    w = tl.load(w_ptr + dims).to(tl.float32)
    if ROUND:  # diffusers' RMSNorm with a half-precision weight: round, multiply, round
        y = (y.to(w_ptr.dtype.element_ty).to(tl.float32) * w[None, :]).to(w_ptr.dtype.element_ty).to(tl.float32)
    else:
        y = y * w[None, :]
    a, b = tl.split(tl.reshape(y, (BLOCK_T, HEAD_DIM // 2, 2)))
    freqs = tl.load(f_ptr + tokens[:, None] * HEAD_DIM + dims[None, :], mask=valid, other=0.0)
    cos, sin = tl.split(tl.reshape(freqs, (BLOCK_T, HEAD_DIM // 2, 2)))
    out = tl.reshape(tl.join(a * cos - b * sin, a * sin + b * cos), (BLOCK_T, HEAD_DIM))
    at = batch * out_stride_b + (out_offset + tokens[:, None]) * out_stride_s + head * HEAD_DIM + dims[None, :]
    tl.store(out_ptr + at, out.to(out_ptr.dtype.element_ty), mask=valid)


def norm_rope_into(
    out: torch.Tensor, offset: int, x: torch.Tensor, weight: torch.Tensor, freqs: torch.Tensor, eps: float
) -> None:
    """Rows ``offset:offset + S`` of ``out`` (``[B, S_joint, H, D]``, contiguous) from ``x`` (``[B, S, H * D]``,
    rows contiguous), ``weight`` (``[D]``) and ``freqs`` (``[S, D / 2, 2]`` fp32 cos/sin pairs)."""
    batch, seq, heads, head_dim = x.shape[0], x.shape[1], out.shape[2], out.shape[3]
    freqs = freqs.to(torch.float32).contiguous()
    grid = (triton.cdiv(seq, BLOCK_T), heads, batch)
    # wrap_triton: under torch.compile inductor launches the kernel from its own generated code (a launch from
    # Python a call made the 512² request CPU-bound: 2.30 s against 1.39). Triton's interpreter (the CPU
    # tests) gives a function of its own, which runs as it is.
    kernel = wrap_triton(_norm_rope) if isinstance(_norm_rope, JITFunction) else _norm_rope
    kernel[grid](
        x,
        weight,
        freqs,
        out,
        seq,
        x.stride(0),
        x.stride(1),
        out.stride(0),
        out.stride(1),
        offset,
        eps,
        HEAD_DIM=head_dim,
        BLOCK_T=BLOCK_T,
        ROUND=weight.dtype in (torch.float16, torch.bfloat16),
    )


@triton_op("omnimodel::norm_rope_joint", mutates_args=())
def norm_rope_joint(
    image: torch.Tensor,
    text: torch.Tensor,
    image_weight: torch.Tensor,
    text_weight: torch.Tensor,
    image_freqs: torch.Tensor,
    text_freqs: torch.Tensor,
    image_eps: float,
    text_eps: float,
    head_dim: int,
) -> torch.Tensor:
    """The joint ``[B, S_image + S_text, H, D]`` queries (or keys) from the two streams' projections
    (``[B, S, H * D]``): each stream's RMS norm (its weight and eps) and rotation (its ``[S, D / 2, 2]`` cos/sin
    pairs), one launch a stream writing its rows."""
    batch, seq_img = image.shape[:2]
    out = image.new_empty((batch, seq_img + text.shape[1], image.shape[2] // head_dim, head_dim))
    norm_rope_into(out, 0, image.contiguous(), image_weight, image_freqs, image_eps)
    norm_rope_into(out, seq_img, text.contiguous(), text_weight, text_freqs, text_eps)
    return out
