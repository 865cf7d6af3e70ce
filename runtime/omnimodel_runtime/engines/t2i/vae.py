"""``vae_2d`` (engine arg): a VAE's causal 3D convolutions run as the 2D convolutions they amount to on a
single frame.

Qwen-Image's VAE (Wan's design) is a video VAE: its encoder's and decoder's convolutions are causal 3D
ones (mostly ``3 x 3 x 3``), which pad the time axis with ``k - 1`` zero frames in front when they have no
cached frames, as on an image (one frame). On such a frame only the kernel's last time tap meets data, so
the output is the 2D convolution of the frame with that tap: the same products without the ``k - 1`` taps
of zeros (two thirds of a ``3 x 3 x 3`` convolution's arithmetic). The tiny Qwen-Image's whole call on
two CPU cores at 256²: 0.30 s against 1.11 (bench/results/t2i-tiny-vae2d-cpu.json). The sums round in
another order (float32: within 1e-5); off by default, so the pixels stay diffusers' own.
"""

from __future__ import annotations

from typing import Any, Final

import torch
import torch.nn.functional as F

# The attribute marking a patched convolution (its own forward is the class's, back once the patch goes).
_PATCHED: Final = "omnimodel_vae_2d"


def _causal_convs(vae: Any) -> list[Any]:
    """diffusers' causal 3D convolutions (Qwen-Image's class) in ``vae`` whose single-frame output
    is one time tap's 2D convolution: all their time padding in front (``2 * padding`` = ``kernel - 1``),
    time stride and dilation 1."""
    from diffusers.models.autoencoders.autoencoder_kl_qwenimage import QwenImageCausalConv3d  # noqa: PLC0415

    return [
        m
        for m in vae.modules()
        if isinstance(m, QwenImageCausalConv3d)
        and m._padding[4] == m.kernel_size[0] - 1
        and m._padding[5] == 0
        and m.stride[0] == 1
        and m.dilation[0] == 1
        and m.padding_mode == "zeros"
    ]


def _forward_2d(conv: Any) -> Any:
    """``conv``'s forward, one frame without cached frames as a 2D convolution (diffusers' causal convolutions
    take the cached frames as a second argument)."""
    original = conv.forward
    padding = (int(conv._padding[2]), int(conv._padding[0]))  # (height, width)

    def forward(x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
        if cache_x is not None or x.shape[2] != 1:
            out: torch.Tensor = original(x, cache_x)
            return out
        # One frame, no cached ones: the zero frames in front meet every tap but the last.
        frame = F.conv2d(
            x[:, :, 0], conv.weight[:, :, -1], conv.bias, conv.stride[1:], padding, conv.dilation[1:], conv.groups
        )
        return frame.unsqueeze(2)

    return forward


def vae_2d(vae: Any) -> int:
    """Install the module docstring's change on ``vae``'s causal convolutions; returns how many. Raises
    ``ValueError`` for a VAE without any (not built on diffusers' causal 3D convolutions)."""
    convs = _causal_convs(vae)
    if not convs:
        raise ValueError(f"engine_args.vae_2d: {type(vae).__name__} has no causal 3D convolutions")
    for conv in convs:
        if not getattr(conv, _PATCHED, False):
            conv.forward = _forward_2d(conv)
            setattr(conv, _PATCHED, True)
    return len(convs)


def undo_vae_2d(vae: Any) -> None:
    """Undo :func:`vae_2d` (benchmarks compare both on one VAE)."""
    for conv in vae.modules():
        if getattr(conv, _PATCHED, False):
            del conv.forward
            delattr(conv, _PATCHED)
