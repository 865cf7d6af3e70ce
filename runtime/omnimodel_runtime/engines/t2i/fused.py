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
- **Image tokens first.** diffusers attends over ``[text; image]``; here the joint sequence is ``[image;
  text]``, the same attention with its keys in another order (its sums round differently). Each row's real
  text tokens then end its sequence, so under ``cfg_batch`` a row attends over a prefix view of the one joint
  tensor instead of a concatenation of its own, and its image part goes into the output projection as a view
  of the attention's output instead of through a zero-padded copy.
- **Each step's modulation from one table** (:class:`ModulationSchedule`). A block's ``img_mod`` and
  ``txt_mod`` (SiLU, then a 3072 x 18432 product) depend on the timestep alone: a call reads 13.6 GB of
  modulation weights to produce 120 rows, ~1.9 ms a branch at 1024² (profiled; the same read at any
  size). Within one pipeline call
  the timesteps are the scheduler's, known before the first step, so the first transformer call computes
  every step's rows in one product per weight (the weights read once for all steps) and each call copies its
  step's rows out of that table. Outside a schedule each call computes its own rows, as diffusers does, only
  outside the compiled blocks. The same products over more rows: a rounding difference, not bit-equal.

- **On CUDA, the query/key norms and rotations as one Triton kernel a block** (engines/t2i/kernels.py): it
  reads each projection once and writes the joint ``[image; text]`` query and key, where inductor's loop
  reduction read each row twice and copied its result into the concatenation: Qwen-Image 1024² 5.04 s
  against 5.22 s with inductor's kernels, 512² 1.32 against 1.35, side by side on the H200
  (bench/results/t2i-qwen-image-fuse-kernel-qk-attnop-pair-h200.json). And the rows' unmasked attention as
  one opaque op (:func:`joint_attention`, on every device), so inductor hands it views of the joint tensors
  instead of copying each row's slices out (1024² 5.12 s without it in another run, with the kernel).

Off by default: diffusers' own blocks stay the reference, and tests check ``fuse_blocks`` against them.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import torch
from diffusers.models.activations import GELU
from diffusers.models.attention_dispatch import AttentionBackendName, dispatch_attention_fn
from diffusers.models.normalization import RMSNorm
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


@torch.library.custom_op("omnimodel::joint_attention", mutates_args=())
def joint_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, ends: list[int], backend: str
) -> list[torch.Tensor]:
    """Unmasked attention over ``[B, S, H, D]`` tensors: with ``ends`` empty one call for the batch
    (``[[B, S, H * D]]``), else one a row, row ``b`` over its first ``ends[b]`` positions (``[1, ends[b],
    H * D]`` each). ``backend``: diffusers' attention backend by name ("" for PyTorch's own pick)."""
    chosen = AttentionBackendName(backend) if backend else None
    spans = [(slice(None), query.shape[1])] if not ends else [(slice(b, b + 1), end) for b, end in enumerate(ends)]
    outs = []
    for row, end in spans:
        out = dispatch_attention_fn(
            query[row, :end], key[row, :end], value[row, :end], dropout_p=0.0, is_causal=False, backend=chosen
        )
        outs.append(out.flatten(2, 3).contiguous())
    return outs


@joint_attention.register_fake
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, ends: list[int], backend: str) -> list[torch.Tensor]:
    width = query.shape[2] * value.shape[3]
    if not ends:
        return [query.new_empty((query.shape[0], query.shape[1], width))]
    return [query.new_empty((1, end, width)) for end in ends]


# Triton (CUDA builds of torch ship it) for engines/t2i/kernels.py; elsewhere the blocks norm and rotate in
# PyTorch operations. Not Final: the benchmarks (bench/t2i_speed.py, t2i_kernels.py) switch it off for their
# ``notriton`` variants.
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def _kernel_applies(attn: Any, hidden_states: torch.Tensor, head_dim: int) -> bool:
    """Whether the kernel (engines/t2i/kernels.py) computes this attention's query and key norms: on CUDA with Triton,
    diffusers' RMS norms with a weight of one dtype and no bias, a power-of-two head size."""
    norms = (attn.norm_q, attn.norm_k, attn.norm_added_q, attn.norm_added_k)
    return (
        _HAS_TRITON
        and hidden_states.is_cuda
        and head_dim & (head_dim - 1) == 0
        and all(isinstance(n, RMSNorm) and n.weight is not None and getattr(n, "bias", None) is None for n in norms)
        and len({n.weight.dtype for n in norms}) == 1
    )


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
            attention_mask = torch.cat([image_mask, encoder_hidden_states_mask.bool()], dim=1)[:, None, None, :]
        head_dim = attn.inner_dim // attn.heads
        seq_img = hidden_states.shape[1]
        img = [p(hidden_states) for p in (attn.to_q, attn.to_k, attn.to_v)]
        txt = [p(encoder_hidden_states) for p in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)]
        # [image; text]: diffusers attends over [text; image], the same softmax over another order of its
        # keys. Image first, each row's real text tokens are a prefix of the joint sequence, so a row
        # attends over a view of the one joint tensor instead of its own concatenation.
        if image_rotary_emb is not None and _kernel_applies(attn, hidden_states, head_dim):
            # On CUDA the norms and rotations write the joint query and key (engines/t2i/kernels.py).
            from omnimodel_runtime.engines.t2i.kernels import norm_rope_qk  # noqa: PLC0415 - Triton: CUDA

            img_freqs, txt_freqs = (torch.view_as_real(f) if f.is_complex() else f for f in image_rotary_emb)
            norms = (attn.norm_q, attn.norm_k, attn.norm_added_q, attn.norm_added_k)
            query, key = norm_rope_qk(
                img[0],
                img[1],
                txt[0],
                txt[1],
                [n.weight for n in norms],
                img_freqs,
                txt_freqs,
                [n.eps for n in norms],
                head_dim,
            )
            value = torch.cat([img[2], txt[2]], dim=1).view(batch, seq_img + seq_txt, -1, head_dim)
        else:
            img = [t.unflatten(-1, (-1, head_dim)) for t in img]
            txt = [t.unflatten(-1, (-1, head_dim)) for t in txt]
            img[0], img[1] = attn.norm_q(img[0]), attn.norm_k(img[1])
            txt[0], txt[1] = attn.norm_added_q(txt[0]), attn.norm_added_k(txt[1])
            if image_rotary_emb is not None:
                img_freqs, txt_freqs = image_rotary_emb
                img[0], img[1] = (rotate(t, img_freqs) for t in img[:2])
                txt[0], txt[1] = (rotate(t, txt_freqs) for t in txt[:2])
            query, key, value = (torch.cat([i, t], dim=1) for i, t in zip(img, txt, strict=True))

        dtype = hidden_states.dtype
        backend = self._attention_backend
        if attention_mask is None and self._parallel_config is None:
            # One opaque op for the rows' attention calls: inductor hands it the joint tensors as they are,
            # and each row attends over a view of them (inside a compiled graph the attention kernel's
            # input constraints made inductor copy each row's slices out first). With the Triton kernel,
            # Qwen-Image 1024² took 5.12 s without this op and 5.04 s with it on the H200, in two runs, not
            # side by side (bench/README.md).
            ends = [seq_img + n for n in text_lengths] if split and text_lengths is not None else []
            rows = [
                r.to(dtype)
                for r in joint_attention(query, key, value, ends, "" if backend is None else str(backend.value))
            ]
        else:

            def attend(end: int, row: slice, mask: torch.Tensor | None) -> torch.Tensor:
                out: torch.Tensor = dispatch_attention_fn(
                    query[row, :end],
                    key[row, :end],
                    value[row, :end],
                    attn_mask=mask,
                    dropout_p=0.0,
                    is_causal=False,
                    backend=backend,
                    parallel_config=self._parallel_config,
                )
                return out.flatten(2, 3).to(dtype)

            if split:
                assert text_lengths is not None
                rows = [attend(seq_img + n, slice(b, b + 1), None) for b, n in enumerate(text_lengths)]
            else:
                rows = [attend(seq_img + seq_txt, slice(None), attention_mask)]
        if split:
            # Each row's image part straight into the output projection (a view of its attention output),
            # its text part padded back to the batch's width: padded positions get zeros, nobody reads them.
            img_out = torch.cat([attn.to_out[0](r[:, :seq_img]) for r in rows])
            txt_joint = torch.cat(
                [torch.nn.functional.pad(r[:, seq_img:], (0, 0, 0, seq_txt - (r.shape[1] - seq_img))) for r in rows]
            )
        else:
            (joint,) = rows
            img_out = attn.to_out[0](joint[:, :seq_img])
            txt_joint = joint[:, seq_img:]
        if len(attn.to_out) > 1:
            img_out = attn.to_out[1](img_out)
        return img_out, attn.to_add_out(txt_joint)


# The attribute of a fused transformer with its :class:`_Modulations`, and the buffer name on each block's
# ``img_mod`` / ``txt_mod`` (non-persistent: not in the state dict) with the rows its block reads this call.
MODULATIONS: Final = "omnimodel_modulations"
ROWS: Final = "omnimodel_rows"


@dataclass(eq=False)
class _Table:
    """Every step's modulation rows of one pipeline call: ``timesteps`` as the transformer receives them,
    ``rows[k, i]`` the k-th modulation's row for ``timesteps[i]``; ``matched`` stays true while every call's
    timestep was one of them (checked once, when the schedule ends: no sync a step)."""

    timesteps: torch.Tensor
    rows: torch.Tensor
    matched: torch.Tensor


@dataclass(eq=False)
class _Modulations:
    """The fused blocks' modulations (``img_mod``, ``txt_mod`` of every block, in order), the one buffer whose
    slices they return, and the table of the schedule in force (None: each call computes its rows)."""

    modules: list[torch.nn.Sequential]
    rows: torch.Tensor | None = None
    scheduler: Any = None
    table: _Table | None = None
    tables_built: int = 0
    calls: list[int] = field(default_factory=lambda: [0, 0])  # [computed, from the table]
    linears: list[torch.nn.Linear] = field(init=False)

    def __post_init__(self) -> None:
        self.linears = [module[1] for module in self.modules]  # type: ignore[misc]

    def _products(self, temb: torch.Tensor, out: torch.Tensor) -> None:
        # SiLU(temb) once for all of them (each module's first layer is the same SiLU), then each product
        # as nn.Linear computes it (addmm), written into its slice of ``out`` ([modules, rows, 6 * dim]).
        act = torch.nn.functional.silu(temb)
        for k, linear in enumerate(self.linears):
            torch.addmm(linear.bias, act, linear.weight.t(), out=out[k])

    def _buffer(self, batch: int, like: torch.Tensor) -> torch.Tensor:
        width = self.linears[0].out_features
        rows = self.rows
        # A new buffer for a new batch size, and for a call in or out of inference mode when the buffer was
        # made in the other (an inference tensor cannot be written outside it).
        if (
            rows is None
            or rows.shape[1] != batch
            or rows.device != like.device
            or rows.dtype != like.dtype
            or rows.is_inference() != torch.is_inference_mode_enabled()
        ):
            rows = like.new_empty((len(self.modules), batch, width))
            for k, module in enumerate(self.modules):
                module.register_buffer(ROWS, rows[k], persistent=False)
            self.rows = rows
        return rows

    @torch.no_grad()
    def fill(self, transformer: Any, timestep: torch.Tensor, hidden_states: torch.Tensor) -> None:
        """This call's rows into the blocks' buffers: from the schedule's table, or computed (for inference:
        the rows carry no gradient)."""
        dtype = hidden_states.dtype
        # What the transformer's forward does first, and one timestep a sample (a scalar is every sample's).
        timestep = torch.broadcast_to(timestep.to(dtype).reshape(-1), hidden_states.shape[:1])
        rows = self._buffer(timestep.shape[0], hidden_states)
        if self.scheduler is None:
            self._products(transformer.time_text_embed(timestep, hidden_states), rows)
            self.calls[0] += 1
            return
        if self.table is None:
            # The values diffusers' Qwen-Image pipelines pass: ``t.expand(batch).to(latents.dtype) / 1000``.
            steps = (self.scheduler.timesteps.to(hidden_states.device, dtype) / 1000).to(dtype)
            table = hidden_states.new_empty((len(self.modules), steps.shape[0], rows.shape[2]))
            self._products(transformer.time_text_embed(steps, hidden_states), table)
            matched = torch.ones((), dtype=torch.bool, device=hidden_states.device)
            self.table = _Table(timesteps=steps, rows=table, matched=matched)
            self.tables_built += 1
        table_ = self.table
        hits = table_.timesteps == timestep[:1]
        index = hits.int().argmax().reshape(1)
        table_.matched &= hits.any() & (timestep == table_.timesteps[index]).all()
        rows.copy_(table_.rows.index_select(1, index).expand_as(rows))
        self.calls[1] += 1


class ModulationSchedule:
    """Context manager over one pipeline call of a fused transformer: each step's modulation rows from one
    table built at the first step (module docstring). ``pipe`` needs ``transformer`` and ``scheduler`` (its
    ``timesteps`` set by the pipeline before the first step). A transformer that is not fused: nothing to do.
    Raises ``RuntimeError`` on leaving when a call's timestep was not among the scheduler's (its rows were
    another step's): a pipeline that passes timesteps otherwise than diffusers' Qwen-Image ones."""

    def __init__(self, pipe: Any) -> None:
        self._modulations: _Modulations | None = getattr(pipe.transformer, MODULATIONS, None)
        self._scheduler = pipe.scheduler

    def __enter__(self) -> ModulationSchedule:
        if self._modulations is not None:
            self._modulations.scheduler, self._modulations.table = self._scheduler, None
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        if self._modulations is None:
            return
        table, self._modulations.table, self._modulations.scheduler = self._modulations.table, None, None
        if kind is None and table is not None and not bool(table.matched):
            raise RuntimeError(
                "fuse_blocks: a transformer call's timestep was not one of the scheduler's timesteps / 1000, "
                "so its modulation rows were another step's"
            )


def _rows_forward(module: torch.nn.Module) -> Any:
    def forward(temb: torch.Tensor) -> torch.Tensor:
        rows: torch.Tensor = getattr(module, ROWS)
        return rows

    return forward


def _modulated_forward(transformer: Any, modulations: _Modulations) -> Any:
    forward = transformer.forward

    signature = inspect.signature(forward)

    def modulated(*args: Any, **kwargs: Any) -> Any:
        given = signature.bind(*args, **kwargs).arguments
        modulations.fill(transformer, given["timestep"], given["hidden_states"])
        return forward(*args, **kwargs)

    modulated.__wrapped__ = forward  # type: ignore[attr-defined]
    return modulated


def _takes_table(transformer: Any) -> bool:
    """Whether ``temb`` is the timestep's embedding alone: no second timestep (``zero_cond_t``: Qwen-Image
    Edit Plus modulates reference tokens with t=0), no extra conditioning, no guidance embedding."""
    embed = getattr(transformer, "time_text_embed", None)
    return (
        embed is not None
        and not getattr(transformer, "zero_cond_t", False)
        and not getattr(embed, "use_additional_t_cond", False)
        and not getattr(getattr(transformer, "config", None), "guidance_embeds", False)
    )


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
    modules = [m for block in transformer.transformer_blocks for m in (block.img_mod, block.txt_mod)]
    if (
        getattr(transformer, MODULATIONS, None) is None
        and _takes_table(transformer)
        and all(map(_is_silu_linear, modules))
    ):
        modulations = _Modulations(modules=modules)
        for module in modules:
            module.forward = _rows_forward(module)
        setattr(transformer, MODULATIONS, modulations)
        transformer.forward = _modulated_forward(transformer, modulations)
    return fused


def _is_silu_linear(module: Any) -> bool:
    return (
        isinstance(module, torch.nn.Sequential)
        and len(module) == 2
        and isinstance(module[0], torch.nn.SiLU)
        and isinstance(module[1], torch.nn.Linear)
    )


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
    modulations = vars(transformer).pop(MODULATIONS, None)
    if modulations is not None:
        for module in modulations.modules:
            vars(module).pop("forward", None)
            module._buffers.pop(ROWS, None)
        if getattr(vars(transformer).get("forward"), "__wrapped__", None) is not None:
            del transformer.forward
