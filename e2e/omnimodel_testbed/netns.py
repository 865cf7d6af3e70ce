"""Run a command in a private network namespace where a non-loopback pod CIDR is local.

Why: kwok can hand pods loopback IPs (127.x) that a test can bind without
privileges, but EndpointSlice/Endpoints validation rejects loopback
addresses, so Services over such pods never get endpoints. A range such as
10.244.0.0/16 is accepted by the apiserver; making it *local* needs
``ip route add local 10.244.0.0/16 dev lo``, which needs CAP_NET_ADMIN. An
unprivileged user namespace grants exactly that, for a private network
namespace only: nothing on the host changes, and nothing inside can reach
the outside network (the test bed needs none).

Everything that talks to the cluster (tests, kubectl, helm, the operator)
must run inside the same namespace, because the cluster's 127.0.0.1 ports
exist only there. The command therefore gets its own state dir, and the
cluster it started (if any) is stopped afterwards by PID from outside.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType

from .binaries import cache_root
from .cluster import Cluster, ClusterError

__all__ = ["CLUSTER_DNS", "NETNS_POD_CIDR", "POD_INTERFACE", "netns_argv", "run_in_netns", "run_passing_signals"]

log = logging.getLogger("omnimodel_testbed")

#: Pod CIDR used inside the namespace (kube-flannel's conventional default).
NETNS_POD_CIDR = "10.244.0.0/16"

# lo up, the pod CIDR local on lo, a network interface that carries each pod's IP as a real pod's eth0
# does (POD_INTERFACE: the pod runner adds and removes the addresses; libraries such as Mooncake's
# transfer engine refuse an address that no non-loopback interface holds), and (in the private mount
# namespace) a resolv.conf that points at the test bed's cluster DNS (omnimodel_testbed.dns), so
# in-cluster names resolve for pod processes.
_SETUP = (
    'set -e; "$1" link set lo up; "$1" route add local "$2" dev lo; '
    '"$1" link add omnipods type veth peer name omnipods-peer; '
    '"$1" link set omnipods up; "$1" link set omnipods-peer up; '
    'mount --bind "$3" /etc/resolv.conf; shift 3; exec "$@"'
)
#: The interface pod IPs are assigned to inside the namespace.
POD_INTERFACE = "omnipods"
#: Where the cluster DNS listens inside the namespace (what the bound resolv.conf names).
CLUSTER_DNS = ("127.0.0.53", 53)


def _which(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin:/bin")
    if path is None:
        raise ClusterError(f"`{name}` not found (needed for the network namespace)")
    return path


def netns_argv(cmd: Sequence[str], resolv_conf: Path, pod_cidr: str = NETNS_POD_CIDR) -> list[str]:
    """argv that runs ``cmd`` in fresh user+network+mount namespaces with ``pod_cidr`` local on lo and
    ``resolv_conf`` bound over /etc/resolv.conf."""
    # Real root needs no user namespace, and must not take one: a namespace that maps only uid 0 has no
    # uid 1000 for a pod's image to run as (container.py). Anyone else gets one, and pods run as its root.
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    return [
        _which("unshare"),
        *user,
        "--net",
        "--mount",
        "--",
        "/bin/sh",
        "-c",
        _SETUP,
        "sh",
        _which("ip"),
        pod_cidr,
        str(resolv_conf),
        *cmd,
    ]


def run_passing_signals(
    argv: Sequence[str],
    env: Mapping[str, str],
    forward: Mapping[signal.Signals, signal.Signals | None],
) -> int:
    """Run ``argv`` to its end and return its exit status, passing signals on as ``forward`` says.

    ``forward`` maps a signal this process gets to the one the child gets, or to None: ignored here,
    because the child got it too (a terminal's Ctrl-C reaches its whole foreground process group). The
    child is never killed early, so whatever it cleans up on an interrupt, it cleans up completely
    (``subprocess.run`` would SIGKILL it 0.25 s after a Ctrl-C).
    """
    started: list[subprocess.Popen[bytes]] = []
    early: list[signal.Signals] = []  # what came before the child existed, passed on once it does

    def handler(signum: int, frame: FrameType | None) -> None:
        to = forward[signal.Signals(signum)]
        if to is None:
            return
        if not started:
            early.append(to)
            return
        with contextlib.suppress(ProcessLookupError):
            started[0].send_signal(to)

    # Caught before the child starts: exec resets caught signals to their defaults, so the child can take
    # every signal it is sent even when this process started with one ignored (a non-interactive shell's
    # `&` job starts with SIGINT ignored, and sh cannot even trap a signal ignored at its start).
    previous = {sig: signal.signal(sig, handler) for sig in forward}
    try:
        child = subprocess.Popen(list(argv), env=dict(env))
        started.append(child)
        for sig in early:
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(sig)
        return child.wait()
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def run_in_netns(
    cmd: Sequence[str],
    *,
    pod_cidr: str = NETNS_POD_CIDR,
    state_dir: Path | None = None,
) -> int:
    """Run ``cmd`` inside the namespace; return its exit code.

    ``OMNIMODEL_TESTBED_POD_CIDR`` and ``OMNIMODEL_TESTBED_STATE_DIR`` are set
    for the command, so ``python -m omnimodel_testbed up`` and the pytest
    fixture inside it pick them up. A temporary state dir is removed after a
    successful run and kept (for its logs) after a failed one.
    """
    if not cmd:
        raise ClusterError("no command given")
    own_dir = state_dir is None
    if state_dir is None:
        parent = cache_root() / "netns"
        parent.mkdir(parents=True, exist_ok=True)
        state_dir = Path(tempfile.mkdtemp(prefix="run-", dir=parent))
    env = dict(os.environ)
    env["OMNIMODEL_TESTBED_POD_CIDR"] = pod_cidr
    env["OMNIMODEL_TESTBED_STATE_DIR"] = str(state_dir)
    env.pop("OMNIMODEL_KUBECONFIG", None)  # a host cluster is unreachable from inside
    try:
        resolv_conf = state_dir / "resolv.conf"
        # Names outside the cluster get NXDOMAIN at once (dns.py), so retries cost them nothing; a cluster
        # name's answer waits on an API read in a busy process: one 1 s try failed pods' probes under load.
        resolv_conf.write_text(f"nameserver {CLUSTER_DNS[0]}\noptions timeout:2 attempts:3\n")
        # Ctrl-C reaches the command from the terminal; a SIGTERM for us becomes its Ctrl-C (pytest then
        # runs its fixtures' teardown, which stops the pod processes it started).
        rc = run_passing_signals(
            netns_argv(cmd, resolv_conf, pod_cidr), env, {signal.SIGINT: None, signal.SIGTERM: signal.SIGINT}
        )
    finally:
        # PIDs are shared with the host, so a cluster left running inside
        # (which keeps the namespace alive) is stopped from here by PID.
        stopped = Cluster(state_dir).down()
        for rec in stopped:
            log.info("stopped leftover %s (pid %d)", rec.name, rec.pid)
    if own_dir and rc == 0:
        shutil.rmtree(state_dir, ignore_errors=True)
    elif own_dir:
        log.info("state (logs) of the failed run kept in %s", state_dir)
    return rc
