r"""Tensors between the text-to-image stages: CPU numpy arrays in ``TensorFrame``\ s, bfloat16 as its raw
bits (numpy has no bfloat16; the true dtype travels in ``meta["dtypes"]``), so nothing is rounded."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

import numpy as np
import torch

from omnimodel_runtime.errors import StageError
from omnimodel_runtime.protocol.stage import ErrorFrame, FinalFrame, ResponseFrame, TensorFrame


def to_wire(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """CPU numpy arrays for a ``TensorFrame``; bfloat16 as its raw bits (the dtype goes in ``meta``)."""
    arrays: dict[str, np.ndarray] = {}
    dtypes: dict[str, str] = {}
    for name, tensor in tensors.items():
        t = tensor.detach().to("cpu").contiguous()
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)
            dtypes[name] = "bfloat16"
        arrays[name] = t.numpy()
    return arrays, dtypes


def from_wire(arrays: Mapping[str, np.ndarray], dtypes: Mapping[str, str], device: str) -> dict[str, torch.Tensor]:
    """Inverse of :func:`to_wire`, on ``device``. Copies: decoded frames are read-only views."""
    out: dict[str, torch.Tensor] = {}
    for name, array in arrays.items():
        t = torch.from_numpy(np.array(array, copy=True))
        if dtypes.get(name) == "bfloat16":
            t = t.view(torch.bfloat16)
        out[name] = t.to(device)
    return out


async def upstream_tensors(
    upstream: AsyncIterator[ResponseFrame], role: str
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The tensors of the upstream stage's frames, once it has finished (its ``FinalFrame``)."""
    tensors: dict[str, np.ndarray] = {}
    dtypes: dict[str, str] = {}
    async for frame in upstream:
        if isinstance(frame, TensorFrame):
            tensors.update(frame.tensors)
            dtypes.update(frame.meta.get("dtypes") or {})
        elif isinstance(frame, ErrorFrame):
            raise frame.to_error()
        elif isinstance(frame, FinalFrame):
            break
    if not tensors:
        raise StageError(f"the {role} stage received no tensors from its upstream stage", status=502)
    return tensors, dtypes
