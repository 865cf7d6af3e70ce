"""Drift, as server-side apply sees it: which fields we set are no longer ours.

The API server records, per field manager, the fields it owns (``metadata.managedFields[].fieldsV1``).
When another client changes a value we set (``kubectl set image``, ``kubectl scale``, an edit), the
server moves that field to the other manager; when it only *adds* something (``kubectl set env`` of a
new variable, an annotation), our fields stay ours. So "a field we set is not in our field set any
more" is exactly "someone changed what the operator manages", and additions by other managers are not
drift: they are kept (SSA semantics) and never make the operator re-apply in a loop.

Values are deliberately not compared: the server normalises some of them (quantities such as ``1.5`` →
``1500m``, defaulted fields), and comparing would turn every normalised field into an endless re-apply.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

from omnimodel_operator import constants as C

Manifest = dict[str, Any]

# Identity fields: part of the request, never recorded in a field set.
_IDENTITY = {"apiVersion", "kind", "status"}
_META_IDENTITY = {"name", "namespace", "generateName"}


def _empty(value: Any) -> bool:
    # Go's omitempty drops these on the way in, so the server may hold (and record) nothing for them.
    return (
        value is None
        or value == ""
        or value is False
        or (isinstance(value, (int, float)) and value == 0)
        or (isinstance(value, (Mapping, list)) and not value)
    )


def _matches(item: Any, key: Mapping[str, Any]) -> bool:
    return isinstance(item, Mapping) and all(item.get(k) == v for k, v in key.items())


def _list_node(item: Any, owned: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The field-set node of one list element: ``k:{...}`` for associative lists (containers by name,
    env by name, ports by port+protocol), ``v:...`` for sets."""
    for entry, node in owned.items():
        if entry.startswith("k:") and _matches(item, json.loads(entry[2:])):
            return node if isinstance(node, Mapping) else {}
        if entry.startswith("v:") and json.loads(entry[2:]) == item:
            return node if isinstance(node, Mapping) else {}
    return None


def _missing(want: Any, owned: Mapping[str, Any], path: str) -> Iterator[str]:
    if not owned:
        # A leaf: the field is owned as a whole (a scalar, an atomic list or an atomic struct).
        return
    if isinstance(want, Mapping):
        for key, value in want.items():
            node = owned.get(f"f:{key}")
            if node is None:
                if not _empty(value):
                    yield f"{path}.{key}"
                continue
            yield from _missing(value, node, f"{path}.{key}")
    elif isinstance(want, list):
        for i, item in enumerate(want):
            node = _list_node(item, owned)
            if node is None:
                yield f"{path}[{i}]"
            else:
                yield from _missing(item, node, f"{path}[{i}]")


def unowned_fields(desired: Mapping[str, Any], fields: Mapping[str, Any]) -> list[str]:
    """Paths of ``desired`` that the field set ``fields`` (a ``fieldsV1`` tree) does not cover."""
    body = {k: v for k, v in desired.items() if k not in _IDENTITY}
    meta = {k: v for k, v in (body.get("metadata") or {}).items() if k not in _META_IDENTITY}
    body = {**body, "metadata": meta} if meta else {k: v for k, v in body.items() if k != "metadata"}
    return list(_missing(body, fields, ""))


def applied_fields(live: Mapping[str, Any], manager: str = C.FIELD_MANAGER) -> Mapping[str, Any] | None:
    """The field set ``manager`` owns through server-side apply, or None if it owns nothing."""
    for entry in live.get("metadata", {}).get("managedFields") or []:
        if entry.get("manager") == manager and entry.get("operation") == "Apply" and not entry.get("subresource"):
            fields: Mapping[str, Any] = entry.get("fieldsV1") or {}
            return fields
    return None


def drift(desired: Manifest, live: Manifest | None) -> str | None:
    """Why ``desired`` must be applied over ``live``, or None when the live object already holds it.

    Missing object; our applied-hash annotation differs (we changed what we render, including fields
    we stopped setting, which only a new apply removes); or a field we set is now another manager's.
    """
    if live is None:
        return "missing"
    ann = C.ANNOTATION_APPLIED_HASH
    if (live["metadata"].get("annotations") or {}).get(ann) != desired["metadata"]["annotations"][ann]:
        return "changed"
    fields = applied_fields(live)
    if fields is None:
        return "not applied by the operator"
    missing = unowned_fields(desired, fields)
    if missing:
        return "changed by another field manager: " + ", ".join(p.lstrip(".") for p in missing[:5])
    return None
