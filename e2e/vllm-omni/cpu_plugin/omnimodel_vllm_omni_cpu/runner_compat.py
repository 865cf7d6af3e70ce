"""Test-bed only: deploy configs that ask for Model Runner V2 get the legacy runner's data plane on a CPU.

A deploy config's ``model_runner: v2`` (Qwen3-TTS's bundled ``qwen3_tts.yaml``) sets two things: each
stage worker's runner, and the stage-to-stage data plane the orchestrator and connectors use
(``supports_native_mrv2_data_plane``). The CPU workers of this plugin run vLLM-Omni's v1 runners on
vLLM's CPU worker and switch the runner back to v1 themselves (``workers.py``, as vLLM-Omni's XPU worker
does), but the data plane still follows the deploy file: the two disagree and a request never finishes
(seen: ``qwen3_tts.yaml`` on CPU, ``/v1/audio/speech`` cancelled after 199 s with v2, answered in 5 s with
v1). vLLM-Omni handles the same mismatch for its own legacy-runner platforms in the bundled configs
(``platforms: {npu,xpu,rocm,musa}: {model_runner: v1}``) and refuses v2 on NPU/XPU outright
(``config/stage_config.py``, ``_apply_platform_overrides``). This patch does what such a ``platforms: cpu``
section would: on the CPU platform, v2 becomes v1 after the platform overrides are applied.

Installed by the platform hook (``activate``) in every vLLM-Omni process; it wraps
``_apply_platform_overrides`` where it is defined and where ``config/omni_config.py`` imported it.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

from omnimodel_vllm_omni_cpu.on_import import patch_on_import

_TARGETS = ("vllm_omni.config.stage_config", "vllm_omni.config.omni_config")
_NAME = "_apply_platform_overrides"
_log = logging.getLogger(__name__)


def _on_cpu() -> bool:
    from vllm_omni.platforms import current_omni_platform  # type: ignore[import-not-found]

    name = current_omni_platform.device_name
    return name is not None and str(name).lower() == "cpu"


def _patch(module: ModuleType) -> None:
    original: Any = getattr(module, _NAME, None)
    if original is None or getattr(original, "_omnimodel_cpu_v1", False):
        return

    def apply_platform_overrides(deploy: Any, platform: str | None = None) -> Any:
        deploy = original(deploy, platform)
        if getattr(deploy, "model_runner", None) == "v2" and (platform == "cpu" or (platform is None and _on_cpu())):
            _log.info("model_runner v2 asked for; the CPU platform's workers run v1: using v1")
            deploy.model_runner = "v1"
        return deploy

    apply_platform_overrides._omnimodel_cpu_v1 = True  # type: ignore[attr-defined]
    setattr(module, _NAME, apply_platform_overrides)


def install() -> None:
    """Patch the two modules now where imported, else when they are (idempotent)."""
    patch_on_import(_TARGETS, _patch)
