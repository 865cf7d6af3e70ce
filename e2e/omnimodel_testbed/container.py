"""Run one container inside its image's root filesystem, as a container runtime does (runc's part).

The process gets new mount and UTS namespaces. In them, a shell of this machine's (``_SETUP``) mounts an
overlay of the unpacked image (``images.py``; the image itself stays unchanged, the container's writes go
to an upper directory of its own, new each start, as a new container's writable layer is), then
``/proc``, ``/sys`` (read-only), a ``/dev`` of its own with the usual character devices and a private
``/dev/shm`` tmpfs of the pod's size, ``/etc/hosts``, ``/etc/hostname`` and ``/etc/resolv.conf``, and each
volume at its mount path (read-only ones remounted ``ro``); with ``readOnlyRootFilesystem`` the overlay
itself is then remounted read-only, so only volumes can be written. Finally this machine's Python
(``_LAUNCH``, loaded before the root changes) chroots into the overlay, changes to the working directory,
drops to the container's uid and gid with no supplementary groups, and execs the command, looked up on
the container's ``PATH`` inside the image. The PID the pod runner holds is the container's own process.

A command run in a running container (an ``exec`` probe or hook: ``exec_argv``) enters that process's
mount and UTS namespaces (``nsenter``) and goes through the same launcher: chroot into the container's
overlay, its working dir, uid and gid, its env (the caller passes the container's).

Not done here (the pod runner's docstring lists the rest): PID, IPC and cgroup namespaces (the pod's
processes see this machine's process table through /proc), capabilities beyond what dropping root to
another uid removes, seccomp.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

__all__ = ["ContainerMount", "container_argv", "exec_argv", "resolve_in_root"]

# $1 lower (the unpacked image), $2 upper, $3 overlay work dir, $4 merged (the container's root), $5 /dev/shm
# size, $6 hostname, $7 read-only root (1 or 0), $8 how many mounts follow, each as (source, target inside
# the container, 1 for read-only else 0); then "--" and the command.
_SETUP: Final = r"""
set -e
image_path=$PATH
PATH=/usr/sbin:/usr/bin:/sbin:/bin
lower=$1 upper=$2 work=$3 root=$4 shm=$5 name=$6 ro=$7 n=$8
shift 8
mount -t overlay overlay -o "lowerdir=$lower,upperdir=$upper,workdir=$work" "$root"
mkdir -p "$root/proc" "$root/sys" "$root/dev" "$root/etc" "$root/tmp"
mount --rbind /proc "$root/proc"
mount --rbind /sys "$root/sys"
mount -o remount,bind,ro "$root/sys"
mount -t tmpfs -o mode=755,nosuid,size=64k dev "$root/dev"
for d in null zero full random urandom tty; do
  : > "$root/dev/$d"
  mount --bind "/dev/$d" "$root/dev/$d"
done
ln -s /proc/self/fd "$root/dev/fd"
ln -s /proc/self/fd/0 "$root/dev/stdin"
ln -s /proc/self/fd/1 "$root/dev/stdout"
ln -s /proc/self/fd/2 "$root/dev/stderr"
mkdir "$root/dev/shm" "$root/dev/pts"
mount -t tmpfs -o "size=$shm,mode=1777,nosuid,nodev" shm "$root/dev/shm"
hostname "$name"
while [ "$n" -gt 0 ]; do
  source=$1 target=$root$2
  if [ -d "$source" ]; then
    mkdir -p "$target"
  else
    mkdir -p "$(dirname "$target")"
    [ -e "$target" ] || : > "$target"
  fi
  mount --bind "$source" "$target"
  if [ "$3" = 1 ]; then mount -o remount,bind,ro "$target"; fi
  shift 3
  n=$((n - 1))
done
if [ "$ro" = 1 ]; then mount -o remount,bind,ro "$root"; fi
[ "$1" = -- ] && shift
PATH=$image_path exec "$@"
"""

# argv: root, working dir, uid, gid, then the command. Runs as this machine's Python, so the image needs
# no shell and no chroot binary of its own.
_LAUNCH: Final = r"""
import os, sys
root, workdir, uid, gid, *argv = sys.argv[1:]
os.chroot(root)
os.makedirs(workdir, exist_ok=True)
os.chdir(workdir)
os.setgroups([])
os.setgid(int(gid))
os.setuid(int(uid))
# The lookup by hand: os.execvpe imports modules lazily, and this machine's stdlib is gone after chroot.
exe = argv[0]
if "/" not in exe:
    dirs = os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin").split(":")
    exe = next((os.path.join(d, exe) for d in dirs if os.access(os.path.join(d, exe), os.X_OK)), exe)
try:
    os.execve(exe, argv, os.environ)
except OSError as exc:
    print(f"exec {argv[0]!r} in the container failed: {exc}", file=sys.stderr)
    sys.exit(127 if isinstance(exc, FileNotFoundError) else 126)
"""


@dataclass(frozen=True)
class ContainerMount:
    """A host file or directory at ``target`` inside the container."""

    source: Path
    target: str
    read_only: bool = False


def resolve_in_root(root: Path, path: str) -> str:
    """``path`` inside the container with the image's symlinks followed as if ``root`` were ``/`` (what
    runc's securejoin does): a mount at /var/run/secrets in an image where /var/run -> /run must land on
    the image's /run, never on this machine's. Components that do not exist yet are kept as given."""
    parts = [p for p in path.split("/") if p not in ("", ".")]
    resolved: list[str] = []
    hops = 0
    while parts:
        part = parts.pop(0)
        if part == "..":
            if resolved:
                resolved.pop()
            continue
        candidate = root.joinpath(*resolved, part)
        if candidate.is_symlink():
            hops += 1
            if hops > 40:
                raise RuntimeError(f"too many symlinks resolving {path} in the image")
            link = os.readlink(candidate)
            if link.startswith("/"):
                resolved = []
            parts = [p for p in link.split("/") if p not in ("", ".")] + parts
            continue
        resolved.append(part)
    return "/" + "/".join(resolved)


def _tool(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path="/usr/bin:/bin:/usr/sbin:/sbin")
    if path is None:
        raise RuntimeError(f"`{name}` not found (needed to run a container)")
    return path


def container_argv(
    command: Sequence[str],
    *,
    image_root: Path,
    state: Path,
    hostname: str,
    mounts: Sequence[ContainerMount],
    shm_size: str,
    uid: int,
    gid: int,
    working_dir: str,
    read_only_root: bool,
) -> list[str]:
    """argv that runs ``command`` in a container of the unpacked image at ``image_root``; ``state`` is a
    fresh directory for the container's writable layer (its overlay's upper, work and merged dirs)."""
    upper, work, merged = state / "upper", state / "work", state / "rootfs"
    for d in (upper, work, merged):
        d.mkdir(parents=True, exist_ok=True)
    # The writable layer's root belongs to the image's root directory owner; the user writes only where
    # the image or a volume lets it.
    if os.geteuid() != 0:
        raise RuntimeError("containers need root (uids other than 0 exist only without a user namespace)")
    mount_args = [
        arg
        for m in mounts
        for arg in (str(m.source), resolve_in_root(image_root, m.target), "1" if m.read_only else "0")
    ]
    unshare = _tool("unshare")
    return [
        unshare, "--mount", "--uts", "--propagation", "private", "--",
        "/bin/sh", "-c", _SETUP, "sh",
        str(image_root), str(upper), str(work), str(merged), shm_size, hostname, "1" if read_only_root else "0",
        str(len(mounts)), *mount_args, "--",
        sys.executable, "-I", "-S", "-c", _LAUNCH, str(merged), working_dir, str(uid), str(gid), *command,
    ]  # fmt: skip


def exec_argv(pid: int, command: Sequence[str], *, state: Path, uid: int, gid: int, working_dir: str) -> list[str]:
    """argv that runs ``command`` inside the running container whose process is ``pid`` and whose
    writable layer is ``state`` (as ``container_argv`` made it): what ``kubectl exec`` and an ``exec``
    probe do."""
    nsenter = _tool("nsenter")
    return [
        nsenter, f"--target={pid}", "--mount", "--uts", "--",
        sys.executable, "-I", "-S", "-c", _LAUNCH, str(state / "rootfs"), working_dir, str(uid), str(gid), *command,
    ]  # fmt: skip
