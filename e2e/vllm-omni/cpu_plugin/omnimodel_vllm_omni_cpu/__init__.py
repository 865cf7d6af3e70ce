"""Test-bed only: a CPU platform for vLLM-Omni 0.30.0, which ships none.

vLLM-Omni loads the entry points of its group ``vllm_omni.platform_plugins`` in every process that
first asks for ``current_omni_platform`` (API server, orchestrator, stage engines, workers) and calls
each one: a plugin answers the qualified name of its platform class, or ``None`` to stay out. This one
answers only when ``OMNIMODEL_VLLM_OMNI_CPU=1`` is set, so installing it changes nothing elsewhere. Keep
this module import-light: it is imported in every vLLM-Omni process.
"""

from __future__ import annotations

import os

ENV_VAR = "OMNIMODEL_VLLM_OMNI_CPU"


def activate() -> str | None:
    """vLLM-Omni's platform hook: our platform's qualified name when enabled, else None."""
    if os.environ.get(ENV_VAR) != "1":
        return None
    from omnimodel_vllm_omni_cpu import diffusion_compat, mooncake_compat, runner_compat

    mooncake_compat.install()
    diffusion_compat.install()
    runner_compat.install()
    return "omnimodel_vllm_omni_cpu.platform.CpuOmniPlatform"
