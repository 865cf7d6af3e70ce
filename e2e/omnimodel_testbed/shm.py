"""Give a process (and its children) a private ``/dev/shm``, as every pod has in a cluster.

On one host, processes of different "pods" would otherwise share ``/dev/shm``, and a shared-memory
shortcut between stages (vLLM-Omni's default connector for streamed chunks, Python's
``multiprocessing.shared_memory``) would pass a test that a cluster, where each pod has its own
``/dev/shm``, fails. A new mount namespace with a tmpfs over ``/dev/shm`` is what a container runtime
does; the process is exec'd in place (no extra fork), so its PID is the one the caller signals.

The same mount namespace makes a pod's read-only volumes read-only for real: each such host directory
(or file) is bind-mounted over itself and remounted ``ro``, so a write fails with EROFS in the pod's
processes while the directory stays writable for everyone else (the pod that fetches into a claim, the
test). The remount keeps the flags of the mount underneath (``nosuid``, ``nodev``, ``noexec``), which a
user namespace may not clear.

Inside the test bed's network namespace the caller is already root of a user namespace and may create
mount namespaces; elsewhere an unprivileged caller gets a user namespace of its own.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

__all__ = ["DEFAULT_SHM_SIZE", "private_shm_argv"]

#: What a container runtime gives a pod that mounts nothing at /dev/shm (Docker's and containerd's default).
DEFAULT_SHM_SIZE = "64m"

# $1: the tmpfs size; $2: how many read-only paths follow, each as (remount options, path); then the command.
_SETUP = (
    'set -e; mount -t tmpfs -o "size=$1,mode=1777,nosuid,nodev" shm /dev/shm; n=$2; shift 2; '
    'while [ "$n" -gt 0 ]; do mount --bind "$2" "$2"; mount -o "remount,bind,$1" "$2"; shift 2; n=$((n-1)); done; '
    'exec "$@"'
)

_KEPT_FLAGS = ((os.ST_NOSUID, "nosuid"), (os.ST_NODEV, "nodev"), (os.ST_NOEXEC, "noexec"))


def _read_only_options(path: Path) -> str:
    flags = os.statvfs(path).f_flag
    return ",".join(["ro", *(name for flag, name in _KEPT_FLAGS if flags & flag)])


def private_shm_argv(cmd: Sequence[str], size: str = DEFAULT_SHM_SIZE, read_only: Sequence[Path] = ()) -> list[str]:
    """argv that runs ``cmd`` in a new mount namespace whose ``/dev/shm`` is an empty tmpfs of ``size``
    and where each of the (existing) ``read_only`` paths is read-only."""
    unshare = shutil.which("unshare") or shutil.which("unshare", path="/usr/bin:/bin")
    if unshare is None:
        raise RuntimeError("`unshare` not found (needed for a private /dev/shm per pod)")
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    paths = list(dict.fromkeys(read_only))
    ro = [arg for p in paths for arg in (_read_only_options(p), str(p))]
    return [
        unshare, *user, "--mount", "--propagation", "private", "--",
        "/bin/sh", "-c", _SETUP, "sh", size, str(len(paths)), *ro, *cmd,
    ]  # fmt: skip
