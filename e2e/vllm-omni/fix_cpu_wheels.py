"""Make PyPI's torchvision/torchaudio builds importable beside CPU torch (run by setup-env, in the env).

vLLM-Omni imports both eagerly (its config layer imports model modules; its API server imports
torchaudio at module level), but PyPI ships builds whose compiled ops do not load against
torch 2.13.0+cpu. Their pure-Python parts are all vLLM-Omni needs on CPU:

- torchvision: ``_meta_registrations.py`` registers fake kernels for ``torchvision::nms``/``qnms``
  unconditionally, and that raises "operator torchvision::nms does not exist" when the compiled ops
  failed to load. Its other registrations are already guarded by ``extension._has_ops()``; guard
  these two the same way.
- torchaudio: with ``lib/*.so`` present the import tries to load them and fails; without them it falls
  back to pure Python (resampling works).

Idempotent; exits non-zero when a file no longer looks like the version this was written for.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_GUARD = "(lambda fn: fn)"


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)  # does not import the package
    if spec is None or spec.origin is None:
        sys.exit(f"fix_cpu_wheels: {name} is not installed")
    return Path(spec.origin).parent


def fix_torchvision() -> None:
    path = _package_dir("torchvision") / "_meta_registrations.py"
    text = path.read_text()
    for op in ("nms", "qnms"):
        plain = f'@torch.library.register_fake("torchvision::{op}")\n'
        guarded = (
            f'@(torch.library.register_fake("torchvision::{op}") if torchvision.extension._has_ops() else {_GUARD})\n'
        )
        if guarded in text:
            continue
        if plain not in text:
            sys.exit(f"fix_cpu_wheels: {path} has no unguarded {op} registration: check the torchvision pin")
        text = text.replace(plain, guarded)
    path.write_text(text)
    print(f"guarded nms/qnms fake registrations in {path}")


def fix_torchaudio() -> None:
    lib = _package_dir("torchaudio") / "lib"
    removed = [p.name for p in sorted(lib.glob("*.so"))]
    for name in removed:
        (lib / name).unlink()
    print(f"removed {removed or 'nothing (already removed)'} from {lib}")


if __name__ == "__main__":
    fix_torchvision()
    fix_torchaudio()
