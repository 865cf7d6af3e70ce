"""Rollout state of a vLLM-Omni OmniModel's stages, from its live Deployments and pods."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from omnimodel_operator import naming
from omnimodel_operator.builders.vllm_omni import head_selector, replica_deployment_name
from omnimodel_operator.status import ComponentState, combine, component_state
from omnimodel_operator.vllm_omni.plan import VllmPlan

Manifest = dict[str, Any]


def _matches(obj: Mapping[str, Any], selector: Mapping[str, str]) -> bool:
    labels = obj["metadata"].get("labels") or {}
    return all(labels.get(k) == v for k, v in selector.items())


def vllm_components(
    plan: VllmPlan, current: Mapping[tuple[str, str], Manifest], pods: Sequence[Manifest]
) -> tuple[list[ComponentState], ComponentState]:
    """Per stage (the head's stage counts the head pod and its extra replicas), and the head as the
    gateway: the pod that serves the API, ready only once every stage has a live replica."""
    head_pods = [p for p in pods if _matches(p, head_selector(plan))]
    head = component_state(
        plan.head.name, current.get(("Deployment", naming.stage_name(plan.name, plan.head.name))), head_pods
    )
    stages = []
    for sp in plan.stages:
        mine = [p for p in pods if _matches(p, naming.stage_selector(plan.name, sp.name))]
        replicas = current.get(("Deployment", replica_deployment_name(plan, sp)))
        if sp.stage.id == plan.head.stage.id:
            parts = [head] + ([component_state(sp.name, replicas, mine)] if (sp.replicas or 1) > 1 else [])
            stages.append(combine(sp.name, parts))
        else:
            stages.append(component_state(sp.name, replicas, mine))
    gateway = component_state(
        "gateway", current.get(("Deployment", naming.stage_name(plan.name, plan.head.name))), head_pods
    )
    return stages, gateway
