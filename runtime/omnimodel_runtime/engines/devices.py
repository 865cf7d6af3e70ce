"""Map ``OMNIMODEL_DEVICE`` (set by the operator from the stage's accelerator vendor) to torch."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.nn.attention import SDPBackend

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


def set_torch_threads(intra: int, inter: int = 1) -> tuple[int, int]:
    """torch's intra-op pool to ``intra`` threads and its inter-op pool to ``inter``; returns the counts
    torch then reports. torch takes an inter-op count only once and only before its first inter-op work;
    a later call leaves the count it has."""
    torch.set_num_threads(intra)
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(inter)
    return torch.get_num_threads(), torch.get_num_interop_threads()


def torch_dtype(name: Any, device: str) -> Any:
    """The dtype to load weights in: explicit ``engine_args.dtype``, else float32 on CPU (CPU kernels
    for half precision are slow or missing) and the checkpoint's own dtype on accelerators."""
    if name is None or name == "auto":
        return torch.float32 if device == "cpu" else "auto"
    try:
        return _DTYPES[str(name)]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r} (use one of {', '.join(_DTYPES)} or auto)") from None


_SDPA_BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}


def sdpa_backends(spec: Any, name: str = "attention") -> list[Any] | None:
    """``auto`` (or unset): None, torch picks the attention kernel itself; else the scaled-dot-product
    kernels torch may pick from, named in ``flash``, ``efficient``, ``cudnn``, ``math`` and separated by
    ``,`` or ``+`` (torch still tries them in its own order and takes the first that accepts the call)."""
    if spec is None or str(spec).strip() in ("", "auto"):
        return None
    names = [n.strip() for n in str(spec).replace("+", ",").split(",") if n.strip()]
    unknown = [n for n in names if n not in _SDPA_BACKENDS]
    if unknown or not names:
        raise ValueError(
            f"{name}: unknown attention kernel(s) {unknown or spec!r}: use auto or some of {', '.join(_SDPA_BACKENDS)}"
        )
    return [_SDPA_BACKENDS[n] for n in names]


# torch's kernel switches are process-wide, and the thinker's and the talker's workers enter their scopes
# from two threads: the first to enter saves the switches, the last to leave restores them (a plain
# sdpa_kernel() per thread would restore stale ones when two overlap).
_SWITCHES: dict[Any, tuple[Callable[[], bool], Callable[[bool], None]]] = {
    SDPBackend.FLASH_ATTENTION: (torch.backends.cuda.flash_sdp_enabled, torch.backends.cuda.enable_flash_sdp),
    SDPBackend.EFFICIENT_ATTENTION: (
        torch.backends.cuda.mem_efficient_sdp_enabled,
        torch.backends.cuda.enable_mem_efficient_sdp,
    ),
    SDPBackend.CUDNN_ATTENTION: (torch.backends.cuda.cudnn_sdp_enabled, torch.backends.cuda.enable_cudnn_sdp),
    SDPBackend.MATH: (torch.backends.cuda.math_sdp_enabled, torch.backends.cuda.enable_math_sdp),
}
_scope_lock = threading.Lock()
_scope: dict[str, Any] = {"depth": 0, "saved": {}, "allowed": set()}


def _switch(allowed: set[Any]) -> None:
    for backend, (_, enable) in _SWITCHES.items():
        enable(backend in allowed)


@contextlib.contextmanager
def sdpa_scope(backends: list[Any] | None) -> Iterator[None]:
    """Scaled-dot-product attention restricted to ``backends`` inside (None: no restriction). Process-wide,
    as torch's switches are: while scopes of several threads overlap, attention may use any kernel one of
    them names, and the switches are restored when the last one leaves."""
    if backends is None:
        yield
        return
    with _scope_lock:
        if _scope["depth"] == 0:
            _scope["saved"] = {backend: enabled() for backend, (enabled, _) in _SWITCHES.items()}
            _scope["allowed"] = set()
        if not set(backends) <= _scope["allowed"]:
            _scope["allowed"] |= set(backends)
            _switch(_scope["allowed"])
        _scope["depth"] += 1
    try:
        yield
    finally:
        with _scope_lock:
            _scope["depth"] -= 1
            if _scope["depth"] == 0:
                for backend, (_, enable) in _SWITCHES.items():
                    enable(_scope["saved"][backend])
