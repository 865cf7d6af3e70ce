"""The one hand-written GPU kernel of ``fuse_blocks``: Qwen-Image's query/key RMS norm and rotary embedding,
written straight into the joint ``[image; text]`` tensor the attention reads (engines/t2i/fused.py).

Under ``compile: regional`` inductor generated this as a loop reduction that reads each row twice and a
copy of its result into the concatenation (bench/README.md has the profile: 11 ms and 4 ms of a 1024²
call). Here a program takes ``BLOCK_T`` tokens of one head of one stream's query or key: loads them once,
norms each ``HEAD_DIM`` row, rotates its channel pairs, stores into its rows of the joint tensor; one launch
a block covers both streams' queries and keys (launches cost CPU time, and 512² is close to CPU-bound). The
arithmetic is diffusers': ``RMSNorm`` (fp32 variance, the product rounded to the weight's dtype before the
weight multiplies, when that is half precision) then ``apply_rotary_emb_qwen`` in fp32. Runs on CUDA (CPU
tests run it under Triton's interpreter); imported lazily.
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
def _rows(  # type: ignore[no-untyped-def]
    x_ptr,
    w_ptr,
    f_ptr,
    out_ptr,
    block,
    seq,
    head,
    batch,
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
    """``BLOCK_T`` tokens (block ``block``) of one head of one stream: norm, rotate, store at ``out_offset``."""
    tokens = block * BLOCK_T + tl.arange(0, BLOCK_T)
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


@triton.jit  # type: ignore[untyped-decorator]
def _norm_rope_qk(  # type: ignore[no-untyped-def]
    q_img_ptr,
    k_img_ptr,
    q_txt_ptr,
    k_txt_ptr,
    wq_img_ptr,
    wk_img_ptr,
    wq_txt_ptr,
    wk_txt_ptr,
    f_img_ptr,
    f_txt_ptr,
    q_out_ptr,
    k_out_ptr,
    seq_img,
    seq_txt,
    img_stride_b,
    img_stride_s,
    txt_stride_b,
    txt_stride_s,
    out_stride_b,
    out_stride_s,
    eps_q_img,
    eps_k_img,
    eps_q_txt,
    eps_k_txt,
    HEAD_DIM: tl.constexpr,  # noqa: N803
    BLOCK_T: tl.constexpr,  # noqa: N803
    ROUND: tl.constexpr,  # noqa: N803
):
    # Axis 0: the image stream's token blocks, then the text stream's; axis 2: (sample, query or key).
    block = tl.program_id(0)
    head = tl.program_id(1)
    batch = tl.program_id(2) // 2
    is_key = tl.program_id(2) % 2
    img_blocks = tl.cdiv(seq_img, BLOCK_T)
    if block < img_blocks:
        if is_key == 0:
            _rows(
                q_img_ptr,
                wq_img_ptr,
                f_img_ptr,
                q_out_ptr,
                block,
                seq_img,
                head,
                batch,
                img_stride_b,
                img_stride_s,
                out_stride_b,
                out_stride_s,
                0,
                eps_q_img,
                HEAD_DIM,
                BLOCK_T,
                ROUND,
            )
        else:
            _rows(
                k_img_ptr,
                wk_img_ptr,
                f_img_ptr,
                k_out_ptr,
                block,
                seq_img,
                head,
                batch,
                img_stride_b,
                img_stride_s,
                out_stride_b,
                out_stride_s,
                0,
                eps_k_img,
                HEAD_DIM,
                BLOCK_T,
                ROUND,
            )
    elif is_key == 0:
        _rows(
            q_txt_ptr,
            wq_txt_ptr,
            f_txt_ptr,
            q_out_ptr,
            block - img_blocks,
            seq_txt,
            head,
            batch,
            txt_stride_b,
            txt_stride_s,
            out_stride_b,
            out_stride_s,
            seq_img,
            eps_q_txt,
            HEAD_DIM,
            BLOCK_T,
            ROUND,
        )
    else:
        _rows(
            k_txt_ptr,
            wk_txt_ptr,
            f_txt_ptr,
            k_out_ptr,
            block - img_blocks,
            seq_txt,
            head,
            batch,
            txt_stride_b,
            txt_stride_s,
            out_stride_b,
            out_stride_s,
            seq_img,
            eps_k_txt,
            HEAD_DIM,
            BLOCK_T,
            ROUND,
        )


def launch_norm_rope_qk(
    q_out: torch.Tensor,
    k_out: torch.Tensor,
    streams: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    freqs: tuple[torch.Tensor, torch.Tensor],
    eps: tuple[float, float, float, float],
) -> None:
    """One launch for ``q_out`` and ``k_out`` (``[B, S_image + S_text, H, D]``, contiguous) from ``streams``
    (image query, image key, text query, text key: ``[B, S, H * D]``, rows contiguous, each stream's pair with
    one layout), their norms' ``weights`` and ``eps`` in that order, and each stream's ``freqs`` (``[S, D / 2,
    2]`` fp32 cos/sin pairs)."""
    q_img, k_img, q_txt, k_txt = streams
    batch, seq_img, seq_txt = q_img.shape[0], q_img.shape[1], q_txt.shape[1]
    heads, head_dim = q_out.shape[2], q_out.shape[3]
    grid = (triton.cdiv(seq_img, BLOCK_T) + triton.cdiv(seq_txt, BLOCK_T), heads, batch * 2)
    # wrap_triton: under torch.compile inductor launches the kernel from its own generated code (a launch from
    # Python a call made the 512² request CPU-bound: 2.30 s against 1.39). Triton's interpreter (the CPU
    # tests) gives a function of its own, which runs as it is.
    kernel = wrap_triton(_norm_rope_qk) if isinstance(_norm_rope_qk, JITFunction) else _norm_rope_qk
    kernel[grid](
        q_img,
        k_img,
        q_txt,
        k_txt,
        *weights,
        *freqs,
        q_out,
        k_out,
        seq_img,
        seq_txt,
        q_img.stride(0),
        q_img.stride(1),
        q_txt.stride(0),
        q_txt.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        *eps,
        HEAD_DIM=head_dim,
        BLOCK_T=BLOCK_T,
        ROUND=weights[0].dtype in (torch.float16, torch.bfloat16),
    )


@triton_op("omnimodel::norm_rope_qk", mutates_args=())
def norm_rope_qk(
    image_query: torch.Tensor,
    image_key: torch.Tensor,
    text_query: torch.Tensor,
    text_key: torch.Tensor,
    weights: list[torch.Tensor],
    image_freqs: torch.Tensor,
    text_freqs: torch.Tensor,
    eps: list[float],
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The joint ``[B, S_image + S_text, H, D]`` queries and keys from the two streams' projections
    (``[B, S, H * D]``): each one's RMS norm (``weights`` and ``eps`` in the order of the arguments: image
    query, image key, text query, text key) and its stream's rotation (``[S, D / 2, 2]`` cos/sin pairs), in
    one launch."""
    batch, seq_img = image_query.shape[:2]
    shape = (batch, seq_img + text_query.shape[1], image_query.shape[2] // head_dim, head_dim)
    query, key = image_query.new_empty(shape), image_query.new_empty(shape)
    image_query, image_key, text_query, text_key = (
        t.contiguous() for t in (image_query, image_key, text_query, text_key)
    )
    launch_norm_rope_qk(
        query,
        key,
        (image_query, image_key, text_query, text_key),
        (weights[0], weights[1], weights[2], weights[3]),
        (image_freqs.to(torch.float32).contiguous(), text_freqs.to(torch.float32).contiguous()),
        (eps[0], eps[1], eps[2], eps[3]),
    )
    return query, key
