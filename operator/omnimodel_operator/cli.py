"""``omnimodel-operator``: run the operator, render what it would apply, print the CRD."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import yaml

from omnimodel_operator import constants as C
from omnimodel_operator.crdgen import render_crd_yaml
from omnimodel_operator.settings import OperatorSettings
from omnimodel_operator.spec import InvalidSpec

if TYPE_CHECKING:
    import kopf

#: kopf's retries of a failed API call once the operator is stopping (its default, 1 to 21 s apart, adds up
#: to 54 s). On the way out kopf makes one call of its own: it removes this pod from the peering object.
#: When that is refused (a 403: `helm upgrade` to cluster-wide or `helm uninstall` deletes the Role in the
#: same breath as the pod) kopf would retry until the kubelet's SIGKILL at the end of the pod's grace
#: period, 30 s with no operator; a few seconds still ride out a blip of the API server.
EXIT_ERROR_BACKOFFS: Final = (1.0, 2.0)


def _documents(path: str) -> list[dict[str, Any]]:
    text = sys.stdin.read() if path == "-" else Path(path).read_text()
    return [d for d in yaml.safe_load_all(text) if d]


def render_documents(docs: Sequence[dict[str, Any]], namespace: str, settings: OperatorSettings) -> str:
    """Multi-document YAML of every child, as the operator would apply them (owner references are
    added by the operator once the object has a uid)."""
    from omnimodel_operator.runtimes import render, resolve  # noqa: PLC0415  (keeps `crd` import-light)

    out: list[dict[str, Any]] = []
    for doc in docs:
        if doc.get("kind") != C.KIND:
            raise InvalidSpec("kind", f"expected kind {C.KIND}, got {doc.get('kind')!r}")
        meta = doc.get("metadata") or {}
        if not meta.get("name"):
            raise InvalidSpec("metadata.name", "an OmniModel needs a name")
        runtime = resolve(
            meta["name"],
            meta.get("namespace") or namespace,
            doc.get("spec") or {},
            settings,
            uid=meta.get("uid"),
        )
        out.extend(render(runtime, settings))
    return yaml.safe_dump_all(out, sort_keys=False, width=120)


def _run(args: argparse.Namespace) -> int:
    import kopf  # noqa: PLC0415

    from omnimodel_operator.preflight import StartupError, preflight  # noqa: PLC0415

    settings = OperatorSettings()
    namespaces = args.namespace or settings.namespaces
    kopf.configure(verbose=args.verbose)
    # httpx (the scrapes) and httpx2 (lightkube's API calls) log every request at INFO: the operator logs
    # what it changed, not each round trip.
    for name in ("httpx", "httpx2"):
        logging.getLogger(name).setLevel(logging.DEBUG if args.verbose else logging.WARNING)
    # kopf would retry a missing config or refused credentials forever without ever serving /healthz.
    try:
        preflight(namespaces, settings.api_startup_timeout)
    except StartupError as err:
        logging.getLogger("omnimodel_operator").error(f"Cannot start: {err}")
        return 1

    from omnimodel_operator import handlers  # noqa: F401, PLC0415  (importing registers the handlers)

    # Without --peering the operator runs alone (kopf's standalone mode). With it, kopf announces this
    # process in the named KopfPeering (per watched namespace) or ClusterKopfPeering object, and pauses
    # its watches while another live process of the same name is announced there, so that the two
    # pods of a rolling upgrade never reconcile at once (see charts/omnimodel-operator/README.md).
    asyncio.run(
        _operate(
            standalone=args.peering is None,
            peering_name=args.peering,
            clusterwide=not namespaces,
            namespaces=namespaces,
            liveness_endpoint=args.liveness,
            memo=kopf.Memo(metrics_host=args.metrics_host),
        )
    )
    return 0


async def _operate(**kwargs: Any) -> None:
    """``kopf.operator(**kwargs)`` (its two halves, as kopf documents for embedding), with our own
    SIGTERM/SIGINT handlers in place of kopf's: they stop the operator as kopf's would, through kopf's
    stop flag, and first bound kopf's retries of failed API calls for the way out (EXIT_ERROR_BACKOFFS)."""
    import kopf  # noqa: PLC0415

    settings = kopf.OperatorSettings()
    stopping = asyncio.Event()
    existing = asyncio.all_tasks()
    tasks = await kopf.spawn_tasks(settings=settings, stop_flag=stopping, **kwargs)
    # spawn_tasks has just installed kopf's handlers; these replace them. Only the main thread gets
    # signals (kopf, run elsewhere, installs none either).
    if threading.current_thread() is threading.main_thread():
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, begin_exit, signum, settings, stopping)
    await kopf.run_tasks(tasks, ignored=existing)


def begin_exit(signum: signal.Signals, settings: kopf.OperatorSettings, stopping: asyncio.Event) -> None:
    """Stop the operator on ``signum``, no longer retrying a failed API call for as long as running kopf
    would (kopf reads the back-offs as each call starts)."""
    if not stopping.is_set():
        logging.getLogger("omnimodel_operator").info(
            f"Received {signum.name}: stopping; a failed API call is retried for {sum(EXIT_ERROR_BACKOFFS):g} s at most"
        )
    settings.networking.error_backoffs = EXIT_ERROR_BACKOFFS
    stopping.set()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omnimodel-operator", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_render = sub.add_parser("render", help="print the children an OmniModel would get, as YAML")
    p_render.add_argument("-f", "--filename", required=True, help="OmniModel YAML file, or - for stdin")
    p_render.add_argument("-n", "--namespace", default="default", help="namespace when the file sets none")
    sub.add_parser("crd", help="print the OmniModel CustomResourceDefinition")
    p_run = sub.add_parser("run", help="run the operator against the current kubeconfig/in-cluster config")
    p_run.add_argument("-n", "--namespace", action="append", help="watch only this namespace (repeatable)")
    p_run.add_argument("--liveness", default=None, help="kopf liveness endpoint, e.g. http://0.0.0.0:8080/healthz")
    p_run.add_argument(
        "--metrics-host",
        default="0.0.0.0",
        help="address /metrics listens on (default: every address of the pod)",
    )
    p_run.add_argument(
        "--peering",
        default=None,
        metavar="NAME",
        help="kopf peering object to announce this operator in (its CRDs and the object must exist); "
        "without it the operator runs standalone",
    )
    p_run.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)

    if args.command == "crd":
        sys.stdout.write(render_crd_yaml())
        return 0
    if args.command == "render":
        try:
            sys.stdout.write(render_documents(_documents(args.filename), args.namespace, OperatorSettings()))
        except InvalidSpec as err:
            print(f"error: invalid OmniModel: {err}", file=sys.stderr)
            return 2
        except (OSError, yaml.YAMLError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        return 0
    return _run(args)


if __name__ == "__main__":
    raise SystemExit(main())
