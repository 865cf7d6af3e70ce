"""What every part of the ``v1alpha1`` API shares: the model base class, CEL helpers, common field types
and the limits and names the rules quote."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Final

from pydantic import BaseModel, ConfigDict, Field, JsonValue, WithJsonSchema
from pydantic.alias_generators import to_camel

from omnimodel_operator.vllm_omni.catalogue import load_catalogue
from omnimodel_runtime.pipeline import ENGINE_TASKS, PRESETS
from omnimodel_runtime.pipeline.graph import STAGE_NAME_MAX, STAGE_NAME_PATTERN

CATALOGUE = load_catalogue()
VLLM_OMNI_VERSION = CATALOGUE.vllm_omni_version
VLLM_OMNI_CONFIGS = tuple(c.name for c in CATALOGUE.configs)
# The stage of a vLLM-Omni model served without a deploy config (one diffusion pipeline).
SINGLE_STAGE = "dit"
MAX_STAGES = 16
MAX_INPUTS = 8
# Child names are <cr>-<stage>; these suffixes belong to the OmniModel's own children.
RESERVED_STAGE_NAMES = ("gateway", "pipeline", "runtime")
DEFAULT_AUTOSCALING_TARGETS = {"cpu": 80.0, "queueDepth": 4.0, "inFlight": 4.0, "pendingSeconds": 10.0}
ALL_TASKS = tuple(sorted({t for tasks in ENGINE_TASKS.values() for t in tasks}))
# tiny://<name> models (built by the runtime, omnimodel_runtime.tiny) → the preset whose graph loads them: each
# preset's own, and variants of one. The operator may not import the runtime's builders (import-linter), so
# the names are kept here; tests/unit/operator checks them against the runtime's registry.
TINY_MODELS: Final[Mapping[str, str]] = {
    **{p: p for p in PRESETS},
    "qwen2.5-omni-vllm-omni": "qwen2.5-omni",
    "qwen3-omni-vllm-omni": "qwen3-omni",
    "text-to-video-ti2v-vllm-omni": "text-to-video",
    "tts-qwen3-vllm-omni": "tts",
}


def cel_list(items: tuple[str, ...]) -> str:
    """A CEL list literal of strings."""
    return "[" + ", ".join(f"'{i}'" for i in items) + "]"


def cel(rule: str, message: str, field_path: str | None = None, reason: str | None = None) -> JsonValue:
    """One ``x-kubernetes-validations`` entry."""
    out: dict[str, JsonValue] = {"rule": rule, "message": message}
    if field_path:
        out["fieldPath"] = field_path
    if reason:
        out["reason"] = reason
    return out


# Kubernetes quantities ("500m", "16Gi", 2): the API server's own int-or-string form.
Quantity = Annotated[
    int | str,
    WithJsonSchema({"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True}),
]
# Free-form objects handed through to Kubernetes or the engine untouched.
FreeForm = Annotated[
    dict[str, Any],
    WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True}),
]
DnsLabel = Annotated[str, Field(pattern=STAGE_NAME_PATTERN, min_length=1, max_length=STAGE_NAME_MAX)]


class KubeModel(BaseModel):
    """camelCase on the wire, snake_case in Python; unknown fields are an error, not silently dropped."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)
