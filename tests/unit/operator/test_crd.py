"""The CRD: generated from the API models, committed, structural, and accepting every example."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from omnimodel_operator.api.v1alpha1 import OmniModel
from omnimodel_operator.crdgen import build_crd, render_crd_yaml

REPO = Path(__file__).parents[3]
CRD_FILE = REPO / "crds" / "omnimodel.io_omnimodels.yaml"
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def walk(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = []
    if isinstance(node, dict):
        out.append((path, node))
        for key, value in node.items():
            out.extend(walk(value, f"{path}/{key}"))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            out.extend(walk(value, f"{path}/{i}"))
    return out


def openapi_schema() -> dict[str, Any]:
    schema: dict[str, Any] = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def test_committed_crd_matches_the_models() -> None:
    assert CRD_FILE.read_text() == render_crd_yaml(), "crds/ is stale: run `make crds`"


def schema_nodes(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    """Every (sub)schema: properties, array items and map values."""
    out = [(path, node)]
    for name, sub in (node.get("properties") or {}).items():
        out.extend(schema_nodes(sub, f"{path}.{name}"))
    if isinstance(node.get("items"), dict):
        out.extend(schema_nodes(node["items"], f"{path}[]"))
    if isinstance(node.get("additionalProperties"), dict):
        out.extend(schema_nodes(node["additionalProperties"], f"{path}{{}}"))
    return out


def test_schema_is_structural() -> None:
    for path, node in walk(openapi_schema()):
        assert "$ref" not in node, path
        assert "title" not in node, path
        assert "default" not in node, path
    for path, node in schema_nodes(openapi_schema()):
        if "anyOf" in node:  # only Kubernetes' own int-or-string form
            assert node.get("x-kubernetes-int-or-string") is True, path
        else:
            assert "type" in node, f"{path or 'root'} has no type"
        if "properties" in node:
            assert node["type"] == "object", path


def test_fields_carry_descriptions_for_kubectl_explain() -> None:
    spec = openapi_schema()["properties"]["spec"]
    for name, prop in spec["properties"].items():
        assert prop.get("description"), f"spec.{name} has no description"
    stage = spec["properties"]["stages"]["items"]["properties"]
    for name, prop in stage.items():
        assert prop.get("description"), f"spec.stages[].{name} has no description"


def test_crd_shape() -> None:
    crd = build_crd()
    names = crd["spec"]["names"]
    assert (names["kind"], names["plural"], names["shortNames"]) == (
        "OmniModel",
        "omnimodels",
        ["omni", "om"],
    )
    version = crd["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Ready", "Reason", "Stages", "Generation", "Observed", "Endpoint", "Age",
    ]  # fmt: skip
    stages = openapi_schema()["properties"]["spec"]["properties"]["stages"]
    assert stages["x-kubernetes-list-type"] == "map"
    assert stages["x-kubernetes-list-map-keys"] == ["name"]
    rules = [r["rule"] for _, n in walk(openapi_schema()) for r in n.get("x-kubernetes-validations", [])]
    assert any("autoscaling" in r for r in rules)
    assert any("self.minReplicas : 1) <= self.maxReplicas" in r for r in rules)
    assert any("j < k" in r for r in rules)  # inputs name earlier stages → DAG


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_example_validates(example: Path) -> None:
    for doc in yaml.safe_load_all(example.read_text()):
        jsonschema.validate(doc, openapi_schema(), cls=jsonschema.Draft4Validator)  # OpenAPI v3 bounds are draft 4's
        OmniModel.model_validate(doc)


def test_schema_rejects_what_the_models_reject() -> None:
    doc = yaml.safe_load((REPO / "examples" / "text-tiny.yaml").read_text())
    doc["spec"]["stages"][0]["replicas"] = -1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, openapi_schema(), cls=jsonschema.Draft4Validator)  # OpenAPI v3 bounds are draft 4's


def test_bounds_are_written_the_openapi_v3_way() -> None:
    """Kubernetes reads exclusiveMinimum/exclusiveMaximum as booleans beside minimum/maximum (OpenAPI v3);
    JSON Schema 2020's numeric form makes the API server refuse the whole CRD."""
    for _, node in walk(openapi_schema()):
        for flag, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
            if flag in node:
                assert node[flag] is True and bound in node, node
