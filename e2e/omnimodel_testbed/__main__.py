"""Command line: ``python -m omnimodel_testbed up|down|status|kubeconfig|helm-path|build|netns|private-shm|demo|enter``.

Only the requested value goes to stdout (so ``$(python -m omnimodel_testbed
kubeconfig)`` works); progress and diagnostics go to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from .binaries import BuildError, ensure_built, run_build_script
from .cluster import Cluster, ClusterError, default_state_dir
from .netns import NETNS_POD_CIDR, run_in_netns
from .procs import ReadinessTimeoutError
from .shm import DEFAULT_SHM_SIZE, private_shm_argv


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m omnimodel_testbed", description=__doc__)
    p.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help=f"cluster state directory (default: {default_state_dir()})",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="build if needed, start, wait until ready (idempotent)")
    up.add_argument("--timeout", type=float, default=180.0, help="readiness deadline in seconds")
    sub.add_parser("down", help="stop every process of the cluster")
    sub.add_parser("status", help="print the cluster state as JSON; exit 0 if up, 1 if not")
    sub.add_parser("kubeconfig", help="print the admin kubeconfig path (exit 1 if not up)")
    sub.add_parser("helm-path", help="print the helm binary path (builds if needed)")
    build = sub.add_parser("build", help="build the binaries (no-op when cached); print the bin dir")
    build.add_argument("--check", action="store_true", help="always run build.sh, even if the cache looks complete")
    ns = sub.add_parser(
        "netns",
        help="run a command in a private network namespace where the pod CIDR is local "
        "(real EndpointSlices + locally served pod IPs, no root needed)",
    )
    ns.add_argument("--pod-cidr", default=NETNS_POD_CIDR, help="pod CIDR routed to lo inside")
    ns.add_argument("cmd", nargs=argparse.REMAINDER, help="command (after --)")
    shm = sub.add_parser("private-shm", help="exec a command with its own empty /dev/shm, as a pod has")
    shm.add_argument("--size", default=DEFAULT_SHM_SIZE, help="tmpfs size (default: %(default)s)")
    shm.add_argument("cmd", nargs=argparse.REMAINDER, help="command (after --)")
    demo = sub.add_parser(
        "demo",
        help="`make demo`: the operator deploys tiny OmniModels on a cluster in a network namespace; "
        "chat, audio, image, scale, teardown (state dir default: $OMNIMODEL_TESTBED_STATE_DIR or <cache>/demo)",
    )
    demo.add_argument(
        "--keep",
        action="store_true",
        default=os.environ.get("DEMO_KEEP", "") not in ("", "0"),
        help="leave everything running at the end (until Ctrl-C) and print how to reach it (env DEMO_KEEP=1)",
    )
    demo.add_argument(
        "--vllm-omni",
        action="store_true",
        default=os.environ.get("DEMO_VLLM_OMNI", "") not in ("", "0"),
        help="also deploy a tiny image model on vLLM-Omni's own engines (head + headless replica); builds "
        "the cached vLLM-Omni environment on first use (env DEMO_VLLM_OMNI=1)",
    )
    demo.add_argument("--out", type=Path, default=None, help="where the WAV and PNG go (default: <state dir>/output)")
    # Internal: the half of the demo that runs inside the network namespace.
    demo.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    demo.add_argument("--t0", type=float, default=None, help=argparse.SUPPRESS)
    push = sub.add_parser(
        "push-images",
        help="push images built by `make images` (buildah's storage) into the test bed's registry storage",
    )
    push.add_argument("images", nargs="+", help="image names as built, e.g. ghcr.io/omnimodel/omnimodel-operator:0.1.0")
    enter = sub.add_parser(
        "enter", help="run a command (default: a shell) inside a running `demo --keep`'s network namespace"
    )
    enter.add_argument("cmd", nargs=argparse.REMAINDER, help="command (after --)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="[testbed %(asctime)s] %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    log = logging.getLogger("omnimodel_testbed")
    try:
        if args.command == "build":
            tc = run_build_script() if args.check else ensure_built()
            print(tc.bin_dir)
            return 0
        if args.command == "netns":
            cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
            return run_in_netns(cmd, pod_cidr=args.pod_cidr, state_dir=args.state_dir)
        if args.command == "private-shm":
            cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
            if not cmd:
                log.error("no command given")
                return 2
            argv = private_shm_argv(cmd, args.size)
            os.execv(argv[0], argv)
        if args.command in ("demo", "enter"):
            from . import demo  # the openai client: only the demo needs it

            if args.command == "enter":
                cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
                return demo.enter(args.state_dir, cmd)
            return demo.run(args, args.state_dir)
        if args.command == "push-images":
            from .registry import push_images

            with tempfile.TemporaryDirectory(prefix="push-") as work:
                for ref in push_images(args.images, Path(work)):
                    print(ref)
            return 0
        if args.command == "helm-path":
            print(ensure_built().path("helm"))
            return 0
        cluster = Cluster(args.state_dir)
        if args.command == "up":
            cluster.timeout = args.timeout
            t0 = time.monotonic()
            state = cluster.up()
            log.info(
                "ready after %.1fs (%s); kubeconfig: %s",
                time.monotonic() - t0,
                "started" if state.started_here else "reused",
                state.kubeconfig,
            )
            print(state.kubeconfig)
            return 0
        if args.command == "down":
            stopped = cluster.down()
            for rec in stopped:
                log.info("stopped %s (pid %d)", rec.name, rec.pid)
            if not stopped:
                log.info("nothing running")
            return 0
        if args.command == "status":
            st = cluster.status()
            print(json.dumps(st, indent=2))
            return 0 if st["up"] else 1
        if args.command == "kubeconfig":
            current = cluster.load_state()
            if current is None or not cluster.healthy(current):
                log.error("no running cluster in %s (run `up` first)", cluster.state_dir)
                return 1
            print(current.kubeconfig)
            return 0
    except (BuildError, ClusterError, ReadinessTimeoutError) as exc:
        log.error("%s", exc)
        return 1
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
