"""Test-bed only: make vLLM-Omni 0.30.0's MooncakeStoreConnector work with the CPU Mooncake wheel.

The connector sets ``ReplicateConfig().with_soft_pin = True``; ``mooncake-transfer-engine-non-cuda``
0.3.13.post1 (the CPU build on PyPI) has ``soft_pin_action``/``soft_pin_ttl_ms`` instead and raises
AttributeError, so the connector never initialises. When the connector module is imported, its
``ReplicateConfig`` is replaced by a Python subclass that accepts the attribute (soft pinning only
affects eviction).

Second, and not a wheel mismatch but a vLLM-Omni 0.30.0 bug (GPU images have it too): the connector
never sets ``stage_id``, which the chunk transfer adapter of ``async_chunk`` pipelines (Qwen3-Omni) reads
on every chunk (``AttributeError: 'MooncakeStoreConnector' object has no attribute 'stage_id'``: no chunk
crosses pods). The shared-memory connector takes it from the stage's connector config
(``stage_id``, injected by ``get_connectors_config_for_stage``); so does this patch.

Installed by the platform hook (``activate``) in every vLLM-Omni process of a test-bed
pod; it does nothing until that module is imported. GPU images ship a Mooncake build that has the
attribute and never load this.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from omnimodel_vllm_omni_cpu.on_import import patch_on_import

_TARGET = "vllm_omni.distributed.omni_connectors.connectors.mooncake_store_connector"


def _patch(module: ModuleType) -> None:
    _patch_stage_id(module)
    base: Any = getattr(module, "ReplicateConfig", None)
    if base is None or hasattr(base(), "with_soft_pin"):
        return

    class ReplicateConfig(base):  # type: ignore[misc, valid-type]
        """Accepts ``with_soft_pin`` (ignored)."""

    module.ReplicateConfig = ReplicateConfig  # type: ignore[attr-defined]


def _patch_stage_id(module: ModuleType) -> None:
    connector: Any = getattr(module, "MooncakeStoreConnector", None)
    if connector is None or getattr(connector, "_omnimodel_stage_id", False):
        return
    init = connector.__init__

    def init_with_stage_id(self: Any, config: dict[str, Any]) -> None:
        self.stage_id = config.get("stage_id", -1)
        init(self, config)

    connector.__init__ = init_with_stage_id
    connector._omnimodel_stage_id = True


def install() -> None:
    """Patch the connector module now if it is imported, else when it is (idempotent)."""
    patch_on_import((_TARGET,), _patch)
