"""The cached vLLM-Omni CPU environment, as the test bed's pod runner uses it.

``e2e/vllm-omni/setup-env`` owns building it (pins in ``e2e/vllm-omni/pins.env``); this module only asks
it for the directory (a no-op taking milliseconds once built) and says how a pod process runs in it.
"""

from __future__ import annotations

import functools
import json
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from . import procs

__all__ = [
    "VLLM_OMNI_CPU_ENV",
    "CommandLineVerdict",
    "VllmOmniEnvError",
    "ensure_env",
    "setup_script",
    "validate_command_lines",
]

#: Environment a vLLM-Omni process needs on this CPU-only machine (see e2e/vllm-omni/README.md):
#: our CPU platform plugin switched on, no CPU pinning (cores are shared), a small KV cache (GiB of host
#: memory per engine), and no hub access (models are local tiny ones).
VLLM_OMNI_CPU_ENV: dict[str, str] = {
    "OMNIMODEL_VLLM_OMNI_CPU": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


class VllmOmniEnvError(RuntimeError):
    """setup-env failed (its log tail went to stderr)."""


def setup_script() -> Path:
    """``e2e/vllm-omni/setup-env`` of this checkout."""
    return Path(__file__).resolve().parent.parent / "vllm-omni" / "setup-env"


@functools.cache
def ensure_env() -> Path:
    """Directory of the ready vLLM-Omni environment, building it first if needed (minutes, cold)."""
    return procs.setup_env(setup_script(), "bin/vllm", VllmOmniEnvError)


@dataclass(frozen=True)
class CommandLineVerdict:
    """What vLLM-Omni's own serve parser said about one argv (see e2e/vllm-omni/validate_cmdline.py)."""

    argv: tuple[str, ...]
    ok: bool
    flag: str | None
    message: str


def validate_command_lines(argvs: Sequence[Sequence[str]]) -> list[CommandLineVerdict]:
    """Parse and validate each ``vllm serve ... --omni`` argv with vLLM-Omni's parser, in its environment.

    One process for all of them (vLLM-Omni's import takes tens of seconds); verdicts in input order.
    """
    script = setup_script().parent / "validate_cmdline.py"
    payload = json.dumps([list(a) for a in argvs])
    proc = subprocess.run(
        [str(ensure_env() / "bin" / "python"), str(script), "-"],
        input=payload,
        capture_output=True,
        text=True,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("ok  [", "error: "))]
    if proc.returncode not in (0, 1) or len(lines) != len(argvs):
        raise VllmOmniEnvError(f"{script} failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    verdicts = []
    for argv, line in zip(argvs, lines, strict=True):
        if line.startswith("ok  ["):
            verdicts.append(CommandLineVerdict(tuple(argv), True, None, ""))
            continue
        flag, _, message = line.removeprefix("error: ").partition(": ")
        verdicts.append(
            CommandLineVerdict(tuple(argv), False, None if flag == "-" else flag, message.rsplit("  [", 1)[0])
        )
    return verdicts
