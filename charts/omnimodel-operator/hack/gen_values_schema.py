#!/usr/bin/env python3
"""Generate the chart's values.schema.json from its documented values.yaml.

values.yaml is the one source: the structure and types come from the default values, the descriptions
from the ``# --`` comment above each key (continued by further ``#`` lines), and extra JSON-schema
constraints from ``# @schema {...}`` lines (a JSON object merged over the inferred schema). Rules:

- every key needs a ``# --`` description (an undocumented value fails the generation);
- a non-empty mapping becomes an object with ``additionalProperties: false`` (typos are rejected)
  unless ``@schema`` says otherwise; an empty mapping is free-form;
- an empty list needs ``@schema {"items": ...}``; a non-empty one takes its items' type from the
  first element.

Usage: ``gen_values_schema.py`` writes the file; ``gen_values_schema.py --check`` exits 1 on drift.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import yaml

CHART_DIR: Final = Path(__file__).resolve().parent.parent
VALUES: Final = CHART_DIR / "values.yaml"
SCHEMA: Final = CHART_DIR / "values.schema.json"

_KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z0-9_.-]+):(?:\s|$)")
_DESC = "# --"
_SCHEMA = "# @schema"

Path_ = tuple[str, ...]


class SchemaError(ValueError):
    """values.yaml lacks a description or carries an annotation the generator cannot use."""


@dataclass
class _Doc:
    description: list[str] = field(default_factory=list)
    schema: dict[str, Any] = field(default_factory=dict)


def _comments(text: str) -> dict[Path_, _Doc]:
    """Map each mapping key's path to the comment block right above it."""
    docs: dict[Path_, _Doc] = {}
    stack: list[tuple[int, str]] = []  # (indent, key) of the enclosing mappings
    pending: _Doc | None = None
    in_desc = False
    for lineno, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not stripped:
            pending, in_desc = None, False
            continue
        if stripped.startswith(_SCHEMA):
            if pending is None:
                raise SchemaError(f"values.yaml:{lineno}: @schema without a preceding `# --` description")
            try:
                extra = json.loads(stripped[len(_SCHEMA) :])
            except json.JSONDecodeError as err:
                raise SchemaError(f"values.yaml:{lineno}: @schema is not JSON: {err}") from err
            if not isinstance(extra, dict):
                raise SchemaError(f"values.yaml:{lineno}: @schema must be a JSON object")
            pending.schema.update(extra)
            in_desc = False
            continue
        if stripped.startswith(_DESC):
            pending = _Doc([stripped[len(_DESC) :].strip()])
            in_desc = True
            continue
        if stripped.startswith("#"):
            if in_desc and pending is not None:
                pending.description.append(stripped[1:].strip())
            continue
        match = _KEY.match(raw)
        if match is None:  # a list item or a continuation line: never a documented key
            pending, in_desc = None, False
            continue
        indent = len(match["indent"])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = (*(k for _, k in stack), match["key"])
        stack.append((indent, match["key"]))
        if pending is not None:
            docs[path] = pending
        pending, in_desc = None, False
    return docs


def _json_type(value: Any, where: str) -> str:
    for py, name in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (list, "array")):
        if isinstance(value, py):
            return name
    if isinstance(value, dict):
        return "object"
    raise SchemaError(f"values.yaml: `{where}` has an unsupported type {type(value).__name__}")


def _infer(value: Any, path: Path_, docs: dict[Path_, _Doc]) -> dict[str, Any]:
    doc = docs.get(path)
    where = ".".join(path) or "<root>"
    if path and (doc is None or not " ".join(doc.description).strip()):
        raise SchemaError(f"values.yaml: `{where}` has no `# --` description")
    schema: dict[str, Any] = {}
    if doc is not None:
        schema["description"] = " ".join(line for line in doc.description if line).strip()
    extra = dict(doc.schema) if doc is not None else {}
    if value is None:
        if "type" not in extra:
            raise SchemaError(f"values.yaml: `{where}` is null; give its type with @schema")
    else:
        schema["type"] = _json_type(value, where)
    if isinstance(value, list):
        if "items" not in extra:
            if not value:
                raise SchemaError(f'values.yaml: empty list `{where}` needs `# @schema {{"items": ...}}`')
            schema["items"] = {"type": _json_type(value[0], where)}
    elif isinstance(value, dict) and value:
        schema["properties"] = {str(k): _infer(v, (*path, str(k)), docs) for k, v in value.items()}
        schema["additionalProperties"] = False
    if path and not isinstance(value, (dict, list)) and value is not None:
        schema["default"] = value
    schema.update(extra)
    return schema


def build_schema(values_text: str) -> dict[str, Any]:
    """The JSON schema (draft-07) for one values.yaml text."""
    values = yaml.safe_load(values_text)
    if not isinstance(values, dict):
        raise SchemaError("values.yaml must be a mapping")
    body = _infer(values, (), _comments(values_text))
    return {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "title": "omnimodel-operator chart values",
        "description": "Generated from values.yaml by hack/gen_values_schema.py; do not edit.",
        **body,
    }


def render(values_text: str) -> str:
    return json.dumps(build_schema(values_text), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if values.schema.json is out of date")
    args = parser.parse_args(argv)
    try:
        text = render(VALUES.read_text())
    except SchemaError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.check:
        if not SCHEMA.exists() or SCHEMA.read_text() != text:
            print(f"{SCHEMA} is out of date: run {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    SCHEMA.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
