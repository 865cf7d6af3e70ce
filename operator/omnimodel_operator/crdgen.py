"""Generate the OmniModel CustomResourceDefinition from the pydantic API models.

Pydantic's JSON schema is close to a Kubernetes structural schema but not equal: ``$ref``s must be
inlined, ``Optional`` fields arrive as ``anyOf [X, null]``, titles are noise and free-form maps need
``x-kubernetes-preserve-unknown-fields``. Defaults are left to the operator (pydantic) rather than
the API server, so that ``has(...)`` in CEL rules means "the user wrote it"; they are quoted in the
description instead so ``kubectl explain`` still shows them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import yaml

from omnimodel_operator import constants as C
from omnimodel_operator.api.v1alpha1 import OmniModelSpec, OmniModelStatus

_DROP_KEYS: Final = frozenset({"title", "default", "$defs", "examples"})

PRINTER_COLUMNS: Final = [
    {
        "name": "Ready",
        "type": "string",
        "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
        "description": "Every stage and the gateway are rolled out and available.",
    },
    {
        "name": "Reason",
        "type": "string",
        "jsonPath": '.status.conditions[?(@.type=="Ready")].reason',
        "description": "Why Ready is what it is (AllStagesReady, Updating, InsufficientCapacity, ...).",
    },
    {
        "name": "Stages",
        "type": "string",
        "jsonPath": ".status.readyStages",
        "description": "Ready stages over total.",
    },
    {
        "name": "Generation",
        "type": "integer",
        "jsonPath": ".metadata.generation",
        "description": "The spec's generation.",
        "priority": 1,
    },
    {
        "name": "Observed",
        "type": "integer",
        "jsonPath": ".status.observedGeneration",
        "description": "The generation the status describes: behind Generation, the status is stale "
        "(the operator has not reconciled the latest spec, or is not running).",
    },
    {
        "name": "Endpoint",
        "type": "string",
        "jsonPath": ".status.endpoint",
        "description": "In-cluster URL of the OpenAI API.",
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def _resolve(node: Any, defs: Mapping[str, Any]) -> Any:
    """Inline refs, collapse Optional, and drop keys a structural schema may not carry."""
    if isinstance(node, list):
        return [_resolve(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _resolve(merged, defs)
    if "anyOf" in node:
        options = [o for o in node["anyOf"] if o != {"type": "null"}]
        if len(options) == 1:
            rest = {k: v for k, v in node.items() if k != "anyOf"}
            return _resolve({**options[0], **rest}, defs)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP_KEYS:
            continue
        if key == "properties":
            out[key] = {name: _resolve(sub, defs) for name, sub in value.items()}
        else:
            out[key] = _resolve(value, defs)
    if "default" in node and node["default"] is not None and "description" in out:
        default = node["default"]
        if not isinstance(default, (dict, list)) and default != "" and "Default" not in out["description"]:
            out["description"] = f"{out['description']} Default: {default}."
    for bound, flag in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        # JSON Schema 2020 (pydantic's gt/lt) writes the bound itself; OpenAPI v3 (Kubernetes) wants
        # the bound in minimum/maximum and a boolean flag.
        if isinstance(out.get(flag), (int, float)) and not isinstance(out.get(flag), bool):
            out[bound] = out[flag]
            out[flag] = True
    if out.get("type") == "object" and out.get("additionalProperties") is True:
        del out["additionalProperties"]
        out["x-kubernetes-preserve-unknown-fields"] = True
    if out.get("additionalProperties") is False:
        # Structural schemas reject unknown fields by pruning; `false` is not allowed there.
        del out["additionalProperties"]
    if "enum" in out and "type" not in out:
        out["type"] = "string"
    if "const" in out:
        out["enum"] = [out.pop("const")]
        out.setdefault("type", "string")
    return out


def structural_schema(model: type[Any]) -> dict[str, Any]:
    """The model's JSON schema as a Kubernetes structural schema."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    schema: dict[str, Any] = _resolve(raw, raw.get("$defs", {}))
    return schema


def build_crd() -> dict[str, Any]:
    """The CRD, as a dict (deterministic: same models → same bytes)."""
    spec = structural_schema(OmniModelSpec)
    spec["description"] = "Desired pipeline: a model, its stage graph (preset or explicit) and per-stage placement."
    status = structural_schema(OmniModelStatus)
    status["description"] = "Observed state, written by the operator."
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": C.CRD_NAME,
            "labels": {C.LABEL_NAME: C.APP_NAME, C.LABEL_PART_OF: C.APP_NAME},
        },
        "spec": {
            "group": C.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": C.KIND,
                "listKind": f"{C.KIND}List",
                "plural": C.PLURAL,
                "singular": C.SINGULAR,
                "shortNames": list(C.SHORT_NAMES),
                "categories": ["all", "omnimodel"],
            },
            "versions": [
                {
                    "name": C.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "OmniModel deploys an omni-modality model as a graph of "
                            "stages: one Deployment and Service per stage, each on its own "
                            "accelerators, plus an OpenAI-compatible gateway.",
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string", "description": "omnimodel.io/v1alpha1"},
                                "kind": {"type": "string", "description": "OmniModel"},
                                "metadata": {"type": "object"},
                                "spec": spec,
                                "status": status,
                            },
                        }
                    },
                }
            ],
        },
    }


def render_crd_yaml() -> str:
    header = "# Generated by `make crds` from omnimodel_operator.api.v1alpha1 — do not edit.\n"
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=120)
