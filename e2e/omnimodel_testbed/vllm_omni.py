"""The cached vLLM-Omni CPU environment, as the test bed's pod runner uses it.

``e2e/vllm-omni/setup-env`` owns building it (pins in ``e2e/vllm-omni/pins.env``); this module only asks
it for the directory (a no-op taking milliseconds once built) and says how a pod process runs in it.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

__all__ = ["VLLM_OMNI_CPU_ENV", "VllmOmniEnvError", "ensure_env", "setup_script"]

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
    proc = subprocess.run(
        ["bash", str(setup_script())], stdout=subprocess.PIPE, stderr=sys.stderr, text=True, check=False
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    if proc.returncode != 0 or not lines:
        raise VllmOmniEnvError(f"{setup_script()} failed with exit code {proc.returncode}")
    env = Path(lines[-1])
    if not (env / "bin" / "vllm").exists():
        raise VllmOmniEnvError(f"{env} has no bin/vllm")
    return env
