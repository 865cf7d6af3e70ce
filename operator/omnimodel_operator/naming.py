"""Child names and labels, in one module so builders, reconcile and tests agree.

Child names must be valid Service names (DNS-1035 labels: lowercase alphanumerics and '-', starting
with a letter, at most 63 characters). An OmniModel's own name is a DNS-1123 *subdomain* (it may contain
dots, start with a digit and run to 253 characters), so names are sanitised, and when anything had
to change the result gets a short hash of the original so that two different OmniModels never collide.
"""

from __future__ import annotations

import hashlib
import re
from typing import Final

from omnimodel_operator import constants as C

MAX_NAME: Final = 63
_HASH_LEN: Final = 8
_INVALID: Final = re.compile(r"[^a-z0-9-]+")


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:_HASH_LEN]


def dns_label(*parts: str) -> str:
    """Join ``parts`` with '-' into a stable DNS-1035 label of at most 63 characters."""
    wanted = "-".join(parts)
    name = _INVALID.sub("-", wanted.lower()).strip("-")
    if not name or not name[0].isalpha():
        name = "om-" + name
    name = re.sub(r"-{2,}", "-", name)
    if name == wanted and len(name) <= MAX_NAME:
        return name
    keep = MAX_NAME - _HASH_LEN - 1
    return f"{name[:keep].rstrip('-')}-{_digest(wanted)}"


def stage_name(cr: str, stage: str) -> str:
    return dns_label(cr, stage)


def gateway_name(cr: str) -> str:
    return dns_label(cr, C.COMPONENT_GATEWAY)


def service_account_name(cr: str) -> str:
    return dns_label(cr, C.COMPONENT_RUNTIME)


def pipeline_configmap_name(cr: str) -> str:
    return dns_label(cr, C.COMPONENT_PIPELINE)


def instance_label(cr: str) -> str:
    """Label values have the same 63-character limit; long CR names get the hashed form."""
    return cr if len(cr) <= MAX_NAME else dns_label(cr)


def common_labels(cr: str, component: str) -> dict[str, str]:
    return {
        C.LABEL_NAME: C.APP_NAME,
        C.LABEL_INSTANCE: instance_label(cr),
        C.LABEL_COMPONENT: component,
        C.LABEL_MANAGED_BY: C.MANAGED_BY,
        C.LABEL_PART_OF: C.APP_NAME,
    }


def owned_selector(cr: str) -> dict[str, str]:
    """Selects every child of one OmniModel (used to list children for pruning)."""
    return {C.LABEL_INSTANCE: instance_label(cr), C.LABEL_MANAGED_BY: C.MANAGED_BY}


def stage_selector(cr: str, stage: str) -> dict[str, str]:
    """Pod selector of a stage; only our own stable labels, never user labels (selectors are immutable)."""
    return {
        C.LABEL_INSTANCE: instance_label(cr),
        C.LABEL_COMPONENT: C.COMPONENT_STAGE,
        C.LABEL_STAGE: stage,
    }


def gateway_selector(cr: str) -> dict[str, str]:
    return {C.LABEL_INSTANCE: instance_label(cr), C.LABEL_COMPONENT: C.COMPONENT_GATEWAY}


def stage_labels(cr: str, stage: str) -> dict[str, str]:
    return {**common_labels(cr, C.COMPONENT_STAGE), C.LABEL_STAGE: stage}


def gateway_labels(cr: str) -> dict[str, str]:
    return common_labels(cr, C.COMPONENT_GATEWAY)
