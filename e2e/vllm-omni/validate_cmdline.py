"""Check rendered vLLM-Omni command lines with vLLM-Omni's own ``serve`` parser. Runs in the vLLM-Omni env.

    <env>/bin/python e2e/vllm-omni/validate_cmdline.py '["vllm","serve","/models/m","--omni",...]' ...
    <env>/bin/python e2e/vllm-omni/validate_cmdline.py - < commands.json   # a JSON list of argv lists

Each argv is parsed the way ``vllm serve ... --omni`` parses it (vLLM-Omni's ``main``:
``TrackingArgumentParser`` + ``OmniServeCommand().subparser_init`` + ``.validate``), without running
anything. A model given as an absolute path that does not exist on this machine (an in-container path such
as ``/models/...``) is replaced, for validation only, by an empty directory of the same name: checks that
need the checkpoint itself are left to start-up. When the argv names a deploy config (``--deploy-config``, a
path or a bundled name), its ``--stage-id`` and the keys of ``--stage-overrides`` must be stage ids of that
config (read with ``load_deploy_config``), since vLLM-Omni itself only finds that out at start-up.

Prints one line per argv on stdout (``ok  [argv]`` or ``error: <flag>: <message>  [argv]``; vLLM's logs go
to stderr) and exits 1 if any failed, 2 on bad input.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.pop("OMNIMODEL_VLLM_OMNI_CPU", None)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# vLLM logs to stdout; keep stdout for the verdicts only (a caller parses them) and send the logs to stderr.
RESULTS = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)

import vllm_omni  # noqa: E402 (after the fd and env setup above)
from vllm.entrypoints.serve.utils.api_utils import cli_env_setup  # noqa: E402 (after the fd and env setup above)
from vllm_omni.config.stage_config import load_deploy_config  # noqa: E402 (after the fd and env setup above)
from vllm_omni.entrypoints.cli.serve import OmniServeCommand, _ensure_vllm_platform  # noqa: E402 (after the fd and env setup above)
from vllm_omni.utils.tracking_parser import TrackingArgumentParser  # noqa: E402 (after the fd and env setup above)

DEPLOY_DIR = Path(vllm_omni.__file__).parent / "deploy"
_FLAG = re.compile(r"(?<![\w-])(-{1,2}[a-zA-Z][\w-]*)")


class CommandLineError(Exception):
    """One argv failed; ``flag`` names the offending option when it can be told."""

    def __init__(self, flag: str | None, message: str) -> None:
        super().__init__(message)
        self.flag = flag


def _flag_in(message: str, argv: list[str]) -> str | None:
    """The first option named in an error message that the argv actually uses (else the first one named)."""
    named = _FLAG.findall(message)
    used = {a.split("=", 1)[0] for a in argv if a.startswith("-")}
    return next((f for f in named if f in used), named[0] if named else None)


class _Parser:
    def __init__(self) -> None:
        cli_env_setup()
        _ensure_vllm_platform()
        self.parser = TrackingArgumentParser(prog="vllm", exit_on_error=False)
        subparsers = self.parser.add_subparsers(required=True, dest="subparser")
        self.serve = OmniServeCommand()
        self.serve.subparser_init(subparsers)

    def check(self, argv: list[str]) -> None:
        if len(argv) < 2 or Path(argv[0]).name != "vllm" or argv[1] != "serve":
            raise CommandLineError(None, f"not a 'vllm serve' command line: {argv[:2]}")
        if "--omni" not in argv:
            raise CommandLineError("--omni", "vLLM-Omni command lines need --omni")
        with tempfile.TemporaryDirectory() as scratch:
            self._check(self._local_model(argv, Path(scratch)), argv)

    @staticmethod
    def _local_model(argv: list[str], scratch: Path) -> list[str]:
        """argv with an absent absolute model path (positional or --model) swapped for an empty stand-in."""
        out = list(argv)
        for i, arg in enumerate(out):
            is_model = (i == 2 and not arg.startswith("-")) or (i > 0 and out[i - 1] == "--model")
            if is_model and arg.startswith("/") and not Path(arg).exists():
                stand_in = scratch / Path(arg).name
                stand_in.mkdir(exist_ok=True)
                out[i] = str(stand_in)
        return out

    def _check(self, argv: list[str], original: list[str]) -> None:
        stderr = io.StringIO()
        try:
            with contextlib.redirect_stderr(stderr):
                args = self.parser.parse_args(argv[1:])
        except SystemExit:
            # argparse printed "usage: ...\nvllm serve: error: argument --x: ..." and exited.
            message = stderr.getvalue().strip().splitlines()[-1] if stderr.getvalue().strip() else "parse error"
            raise CommandLineError(_flag_in(message, original), message) from None
        except argparse.ArgumentError as exc:
            raise CommandLineError(exc.argument_name or _flag_in(str(exc), original), str(exc)) from None
        try:
            self.serve.validate(args)
        except (ValueError, TypeError) as exc:
            raise CommandLineError(_flag_in(str(exc), original), str(exc)) from None
        self._check_stage_ids(args)

    @staticmethod
    def _check_stage_ids(args: Any) -> None:
        deploy = getattr(args, "deploy_config", None)
        if not deploy:
            return
        path = Path(deploy)
        if not path.exists():
            bundled = DEPLOY_DIR / path.name
            if path.parent != Path(".") and not bundled.exists():
                raise CommandLineError("--deploy-config", f"deploy config {deploy!r} not found")
            path = bundled
            if not path.exists():
                raise CommandLineError("--deploy-config", f"{deploy!r} is not a bundled deploy config")
        ids = {s.stage_id for s in load_deploy_config(path).stages}
        stage_id = getattr(args, "stage_id", None)
        if stage_id is not None and stage_id not in ids:
            raise CommandLineError("--stage-id", f"--stage-id {stage_id} is not a stage of {path.name} {sorted(ids)}")
        for key in getattr(args, "stage_overrides", None) or {}:
            if not str(key).isdigit() or int(key) not in ids:
                raise CommandLineError(
                    "--stage-overrides", f"--stage-overrides key {key!r} is not a stage of {path.name} {sorted(ids)}"
                )


def _read(argv: list[str]) -> list[list[str]]:
    items: list[Any] = []
    for arg in argv:
        value = json.loads(sys.stdin.read() if arg == "-" else arg)
        is_list_of_lists = isinstance(value, list) and value and all(isinstance(v, list) for v in value)
        items.extend(value if is_list_of_lists else [value])
    for item in items:
        if not (isinstance(item, list) and all(isinstance(a, str) for a in item)):
            raise ValueError(f"not an argv list of strings: {item!r}")
    return items


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        commands = _read(argv)
    except ValueError as exc:
        print(f"bad input: {exc}", file=sys.stderr)
        return 2
    parser = _Parser()
    failed = 0
    for command in commands:
        shown = " ".join(command)
        try:
            parser.check(command)
        except CommandLineError as exc:
            failed += 1
            print(f"error: {exc.flag or '-'}: {exc}  [{shown}]", file=RESULTS)
        else:
            print(f"ok  [{shown}]", file=RESULTS)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
