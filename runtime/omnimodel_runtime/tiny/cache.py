"""Build-once cache of tiny models under the model cache directory.

Several processes (a stage and a gateway in a test, replicas sharing a volume) may ask for the same tiny
model at the same moment: one builds under an exclusive file lock into a temporary directory and renames
it into place atomically; the others wait on the lock and then find the finished directory. A directory
is only ever visible complete, so a build killed halfway leaves nothing that looks usable.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from pathlib import Path

from omnimodel_runtime.tiny.registry import build_tiny, get_builder

# Written last into a finished build; its presence is what "complete" means.
MARKER = "omnimodel-tiny.json"


def tiny_cache_dir(cache_root: Path, preset: str, *, seed: int | None = None) -> Path:
    """Where the tiny model of ``preset`` lives inside ``cache_root`` (versioned by builder and seed)."""
    builder = get_builder(preset)
    seed = builder.default_seed if seed is None else seed
    return cache_root / "tiny" / f"{preset}-v{builder.version}-seed{seed}"


def is_complete(path: Path) -> bool:
    """True when ``path`` holds a finished build."""
    return (path / MARKER).is_file()


def ensure_tiny(preset: str, cache_root: Path, *, seed: int | None = None) -> Path:
    """Return the directory of ``preset``'s tiny model, building it first if no process has yet."""
    builder = get_builder(preset)
    seed = builder.default_seed if seed is None else seed
    target = tiny_cache_dir(cache_root, preset, seed=seed)
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.parent / f".{target.name}.lock"
    with lock_path.open("a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            # Someone else may have finished while we waited for the lock.
            if is_complete(target):
                return target
            if target.exists():
                # A leftover without a marker: not ours to trust.
                shutil.rmtree(target)
            tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
            # mkdtemp's 0700 would hide the model from every other user of a shared cache (a pod of the
            # image's uid reading what a root process built, or another uid under the same fsGroup).
            tmp.chmod(0o755)
            try:
                build_tiny(preset, tmp, seed=seed)
                marker = {"preset": preset, "seed": seed, "builder_version": builder.version}
                (tmp / MARKER).write_text(json.dumps(marker) + "\n")
                os.rename(tmp, target)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return target
