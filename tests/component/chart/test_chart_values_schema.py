"""values.schema.json: generated from the documented values.yaml, and strict enough to catch typos."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import jsonschema
import pytest
import yaml
from chartkit import CHART

from omnimodel_operator.accelerators import ACCELERATORS


def _load_generator() -> ModuleType:
    name = "omnimodel_chart_gen_values_schema"
    spec = importlib.util.spec_from_file_location(name, CHART / "hack" / "gen_values_schema.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


GEN = _load_generator()
SCHEMA: dict[str, Any] = json.loads((CHART / "values.schema.json").read_text())
VALUES: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())


def properties(schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    for name, sub in schema.get("properties", {}).items():
        yield f"{path}.{name}".lstrip("."), sub
        yield from properties(sub, f"{path}.{name}")


def test_every_value_is_documented() -> None:
    for path, sub in properties(SCHEMA):
        assert sub.get("description"), f"{path} has no description"


def test_defaults_satisfy_the_schema() -> None:
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    jsonschema.validate(VALUES, SCHEMA)


@pytest.mark.parametrize(
    "override",
    [
        {"imagee": {}},  # typo at the top
        {"image": {"tag": 1}},
        {"crds": {"enable": True}},  # typo in a nested key
        {"runtime": {"images": {"nvida": "x"}}},
        {"watchNamespaces": "ml"},
        {"operator": {"healthPort": 70000}},
        {"serviceAccount": {"annotations": {"a": 1}}},
    ],
)
def test_schema_rejects_mistakes(override: dict[str, Any]) -> None:
    merged = {**VALUES, **{k: {**VALUES.get(k, {}), **v} if isinstance(v, dict) else v for k, v in override.items()}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(merged, SCHEMA)


def test_free_form_kubernetes_fields_stay_open() -> None:
    merged = {
        **VALUES,
        "affinity": {"podAntiAffinity": {}},
        "securityContext": {**VALUES["securityContext"], "seLinuxOptions": {"level": "s0"}},
        "resources": {"limits": {"memory": "1Gi", "ephemeral-storage": "1Gi"}},
    }
    jsonschema.validate(merged, SCHEMA)


def test_runtime_image_vendors_are_the_accelerator_vendors() -> None:
    images = SCHEMA["properties"]["runtime"]["properties"]["images"]
    assert images["propertyNames"]["enum"] == sorted(v.value for v in ACCELERATORS)


def test_generator_requires_a_description() -> None:
    with pytest.raises(GEN.SchemaError, match=r"`a\.b` has no"):
        GEN.build_schema("# -- A.\na:\n  b: 1\n")


def test_generator_requires_items_for_empty_lists() -> None:
    with pytest.raises(GEN.SchemaError, match="empty list `xs`"):
        GEN.build_schema("# -- Xs.\nxs: []\n")


def test_generator_infers_types_and_merges_annotations() -> None:
    schema = GEN.build_schema(
        "# -- An object\n# over two lines.\nobj:\n"
        '  # -- A port.\n  # @schema {"maximum": 65535}\n  port: 8080\n'
        "  # -- Flags.\n  flags: [a, b]\n"
        "# -- Free.\nfree: {}\n"
    )
    obj = schema["properties"]["obj"]
    assert obj["description"] == "An object over two lines."
    assert obj["additionalProperties"] is False
    assert obj["properties"]["port"] == {"description": "A port.", "type": "integer", "default": 8080, "maximum": 65535}
    assert obj["properties"]["flags"]["items"] == {"type": "string"}
    assert schema["properties"]["free"] == {"description": "Free.", "type": "object"}


def test_generator_rejects_annotations_that_are_not_json() -> None:
    with pytest.raises(GEN.SchemaError, match="not JSON"):
        GEN.build_schema("# -- A.\n# @schema {maximum: 1}\na: 1\n")
