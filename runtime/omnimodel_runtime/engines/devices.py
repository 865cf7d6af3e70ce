"""Map ``OMNIMODEL_DEVICE`` (set by the operator from the stage's accelerator vendor) to torch."""

from __future__ import annotations

from typing import Any

import torch

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


def resolve_device(setting: str) -> str:
    """``auto`` picks the first accelerator torch can see (cuda covers ROCm), else the CPU."""
    if setting != "auto":
        return setting
    if torch.cuda.is_available():
        return "cuda"
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return "xpu"
    npu = getattr(torch, "npu", None)  # present once torch_npu is imported
    if npu is not None and npu.is_available():
        return "npu"
    return "cpu"


def torch_dtype(name: Any, device: str) -> Any:
    """The dtype to load weights in: explicit ``engine_args.dtype``, else float32 on CPU (CPU kernels
    for half precision are slow or missing) and the checkpoint's own dtype on accelerators."""
    if name is None or name == "auto":
        return torch.float32 if device == "cpu" else "auto"
    try:
        return _DTYPES[str(name)]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r} (use one of {', '.join(_DTYPES)} or auto)") from None
