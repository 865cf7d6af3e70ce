"""vLLM-Omni as a runtime: what the operator knows about vLLM-Omni without importing it.

``catalogue.json`` is generated from vLLM-Omni's own config loader by ``e2e/vllm-omni/gen_catalogue.py``
(``make vllm-omni-catalogue``) and drift-checked against the pinned version
(``make vllm-omni-catalogue-check``); :mod:`.catalogue` reads it.
"""

from omnimodel_operator.vllm_omni.catalogue import (
    Catalogue,
    CatalogueEdge,
    CatalogueStage,
    DeployConfigEntry,
    KvTransfer,
    StageType,
    load_catalogue,
)

__all__ = [
    "Catalogue",
    "CatalogueEdge",
    "CatalogueStage",
    "DeployConfigEntry",
    "KvTransfer",
    "StageType",
    "load_catalogue",
]
