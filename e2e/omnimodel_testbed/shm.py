"""Give a process (and its children) a private ``/dev/shm``, as every pod has in a cluster.

On one host, processes of different "pods" would otherwise share ``/dev/shm``, and a shared-memory
shortcut between stages (vLLM-Omni's default connector for streamed chunks, Python's
``multiprocessing.shared_memory``) would pass a test that a cluster, where each pod has its own
``/dev/shm``, fails. A new mount namespace with a tmpfs over ``/dev/shm`` is what a container runtime
does; the process is exec'd in place (no extra fork), so its PID is the one the caller signals.

Inside the test bed's network namespace the caller is already root of a user namespace and may create
mount namespaces; elsewhere an unprivileged caller gets a user namespace of its own.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence

__all__ = ["DEFAULT_SHM_SIZE", "private_shm_argv"]

#: What a container runtime gives a pod that mounts nothing at /dev/shm (Docker's and containerd's default).
DEFAULT_SHM_SIZE = "64m"

_SETUP = 'set -e; mount -t tmpfs -o "size=$1,mode=1777,nosuid,nodev" shm /dev/shm; shift; exec "$@"'


def private_shm_argv(cmd: Sequence[str], size: str = DEFAULT_SHM_SIZE) -> list[str]:
    """argv that runs ``cmd`` in a new mount namespace whose ``/dev/shm`` is an empty tmpfs of ``size``."""
    unshare = shutil.which("unshare") or shutil.which("unshare", path="/usr/bin:/bin")
    if unshare is None:
        raise RuntimeError("`unshare` not found (needed for a private /dev/shm per pod)")
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    return [unshare, *user, "--mount", "--propagation", "private", "--", "/bin/sh", "-c", _SETUP, "sh", size, *cmd]
