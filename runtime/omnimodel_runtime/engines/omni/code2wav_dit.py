"""The code2wav DiT outside its engine: :func:`sample_mel` (the DiT's own ``sample()`` from given noise), the
position-consistent noise of the chunked path (:class:`PagedNoise`) and its chunk geometry (:class:`ChunkPlan`,
one DiT pass of a stream: :class:`_Window`). The engine is :mod:`~omnimodel_runtime.engines.omni.code2wav`."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from omnimodel_runtime.engines.base import flag
from omnimodel_runtime.errors import StageError

# The whole model's token2wav defaults.
TOKEN2WAV_DEFAULTS: dict[str, Any] = {"num_steps": 10, "guidance_scale": 0.5, "sway_coefficient": -1.0}
# Chunking, in DiT attention blocks (24 mel frames = 12 codes = 0.24 s each, at the released geometry):
# chunks of 2 blocks (vLLM-Omni's geometry; the first may be set apart with ``first_chunk_blocks``: 1 block
# leaves nothing to vocode until the second chunk, whose audio needs the vocoder's right context), each
# with 2 blocks of left context and 1 block of look-ahead; the vocoder gets 24
# mel frames of context on each side, which covers BigVGAN's receptive field at the released kernel and
# dilation sizes (16 already makes chunked vocoding equal one pass to ~1e-6).
#
# A stream that has fallen behind (more codes waiting than one chunk) takes a larger chunk, up to
# ``max_chunk_blocks``, doubling from ``chunk_blocks``: a DiT pass costs about the same whatever its
# window's length (36 evaluations of ~1000 small kernels each, even as one CUDA graph), so larger chunks
# cut the passes a stream needs. Every chunk keeps the same left context and look-ahead, so the chunked
# audio stays within the tolerance of one pass that docs/pipelines/qwen2.5-omni.md states (fewer seams).
CHUNK_DEFAULTS: dict[str, int] = {
    "first_chunk_blocks": 2,
    "chunk_blocks": 2,
    "max_chunk_blocks": 8,
    "left_blocks": 2,
    "lookahead_blocks": 1,
    "vocoder_context": 24,
}


def sample_mel(
    dit: Any,
    cond: torch.Tensor,
    ref_mel: torch.Tensor,
    codes: torch.Tensor,
    noise: torch.Tensor,
    *,
    num_steps: int = 10,
    guidance_scale: float = 0.5,
    sway_coefficient: float | None = -1.0,
    check: Any = None,
) -> torch.Tensor:
    """``Qwen2_5OmniToken2WavDiTModel.sample()`` starting from ``noise`` (1, 2·codes, mel_dim) instead of
    drawing it from the global generator; returns mel (1, mel_dim, frames). ``check`` runs before every
    DiT evaluation (cancellation)."""
    frames = noise.shape[1]
    if frames > dit.config.max_position_embeddings:
        raise StageError(
            f"{frames} mel frames exceed the DiT's limit of {dit.config.max_position_embeddings}", status=400
        )
    cond = cond.unsqueeze(1).repeat(1, frames, 1)

    def ode_function(time_step: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        if check is not None:
            check()
        if guidance_scale < 1e-5:
            out: torch.Tensor = dit(
                hidden_states=hidden_states,
                speaker_embedding=cond,
                condition_vector=ref_mel,
                quantized_code=codes,
                time_step=time_step,
                drop_audio_conditioning=False,
                drop_code=False,
                apply_cfg=False,
            )
            return out
        output = dit(
            hidden_states=hidden_states,
            quantized_code=codes,
            speaker_embedding=cond,
            condition_vector=ref_mel,
            time_step=time_step,
            apply_cfg=True,
        )
        guided, null = torch.chunk(output, 2, dim=0)
        return guided + (guided - null) * guidance_scale

    times = torch.linspace(0, 1, num_steps, device=codes.device, dtype=cond.dtype)
    if sway_coefficient is not None:
        times += sway_coefficient * (torch.cos(torch.pi / 2 * times) - 1 + times)
    mel: torch.Tensor = _rk4(ode_function, noise, times).permute(0, 2, 1)
    return mel


def _rk4(function: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], y0: torch.Tensor, times: torch.Tensor) -> Any:
    """``RungeKutta4ODESolver(function, y0).integrate(times)[-1]``, the same operations in the same order.
    The solver also interpolates the solution at every time point, comparing device tensors on the host to
    find them; for increasing time points (the sway schedule is) every point is an interval's end, so its
    last solution is the last step's value, and nothing here waits for the device."""
    one_third, two_thirds = 1 / 3, 2 / 3
    value = y0
    for start, end in itertools.pairwise(times):
        step = end - start
        k1 = function(start, value)
        k2 = function(start + step * one_third, value + step * k1 * one_third)
        k3 = function(start + step * two_thirds, value + step * (k2 - k1 * one_third))
        k4 = function(end, value + step * (k1 - k2 + k3))
        value = value + (k1 + 3 * (k2 + k3) + k4) * step / 8
    return value


class PagedNoise:
    """A position-consistent noise sequence drawn in pages of one DiT block: frame i has the same noise
    whichever window asks for it, so neighbouring chunks agree where their windows overlap."""

    def __init__(self, seed: int, page: int, mel_dim: int, device: str) -> None:
        self._gen = torch.Generator(device=device)
        self._gen.manual_seed(seed)
        self._page, self._dim, self._device = page, mel_dim, device
        self._pages: list[torch.Tensor] = []

    def frames(self, start: int, end: int) -> torch.Tensor:
        while len(self._pages) * self._page < end:
            self._pages.append(
                torch.randn([1, self._page, self._dim], generator=self._gen, device=self._device, dtype=torch.float32)
            )
        return torch.cat(self._pages, dim=1)[:, start:end]


@dataclass
class ChunkPlan:
    """Chunk geometry in codes (one DiT block = ``block`` codes) and vocoder context in mel frames."""

    block: int
    chunk: int  # a chunk's usual size
    left: int
    lookahead: int
    vocoder_context: int
    first: int = 0  # the first chunk's size (default: ``chunk``)
    sizes: tuple[int, ...] = ()  # chunk sizes a stream that is behind may take, ascending (default: ``chunk``)
    grow: bool = False  # a stream far enough ahead of real time waits for larger chunks (see least)

    @classmethod
    def from_args(cls, dit_config: Any, args: dict[str, Any]) -> ChunkPlan:
        values = {**CHUNK_DEFAULTS, **{k: int(v) for k, v in args.items() if k in CHUNK_DEFAULTS}}
        block = max(1, int(dit_config.block_size) // int(dit_config.repeats))
        chunk = block * max(1, values["chunk_blocks"])
        sizes = [chunk]
        while sizes[-1] * 2 <= block * values["max_chunk_blocks"]:
            sizes.append(sizes[-1] * 2)
        return cls(
            block=block,
            chunk=chunk,
            left=block * values["left_blocks"],
            lookahead=block * values["lookahead_blocks"],
            vocoder_context=values["vocoder_context"],
            first=block * max(1, values["first_chunk_blocks"]),
            sizes=tuple(sizes),
            grow=flag(args, "grow_chunks", default=True),
        )

    def least(self, chunks: int, lead: float, code_seconds: float) -> int:
        """The smallest chunk (codes) a stream that has run ``chunks`` chunks and whose audio sent is ``lead``
        seconds ahead of real time should run next (it waits for more codes until then).

        Every DiT pass costs about the same whatever its chunk, and a stream's passes share the GPU with the
        talker's steps, so fewer, larger chunks finish the audio sooner; but waiting for codes must not let
        the listener run out of audio. With ``grow``, the n-th chunk after the first waits for ``sizes[n-1]``
        (doubling up to the largest) only while the audio sent is ahead of real time by at least that
        chunk's duration (``code_seconds`` a code): gathering it takes less than that whenever the talker is
        faster than real time. Otherwise it runs what has arrived (a chunk of the smallest size, or larger
        when that much is waiting)."""
        sizes = self.sizes or (self.chunk,)
        want = sizes[min(max(chunks - 1, 0), len(sizes) - 1)]
        return want if self.grow and lead >= want * code_seconds else sizes[0]

    def vocoder_frames(self, repeats: int) -> set[int]:
        """Mel lengths (frames) BigVGAN gets for a stream's chunks away from its end, at ``repeats`` mel
        frames a code (time-stretched speech aside): the first chunk's mel (when it leaves more than the
        right context), the second's (behind the first's unvoiced tail), then the steady ones (context on
        both sides of the chunk)."""
        first, ctx = (self.first or self.chunk) * repeats, self.vocoder_context
        out = {first} if first > ctx else set()
        for size in self.sizes or (self.chunk,):
            out.add(size * repeats + min(first, 2 * ctx))
            out.add(size * repeats + 2 * ctx)
        return out

    def windows(self) -> set[int]:
        """Window lengths (codes) of a stream's chunks away from its end: the first, the second (whose left
        context is the first chunk only), then the steady ones."""
        first, sizes = self.first or self.chunk, self.sizes or (self.chunk,)
        out = {first + self.lookahead}
        for size in sizes:
            out.add(min(first, self.left) + size + self.lookahead)
            out.add(self.left + size + self.lookahead)
        return out


@dataclass
class _Window:
    """One DiT pass of a chunked stream: codes ``[lo, hi)`` around the chunk ``[start, end)``."""

    codes: torch.Tensor  # (hi - lo,)
    noise: torch.Tensor  # (frames, mel_dim)
    lo: int
    start: int
    end: int
