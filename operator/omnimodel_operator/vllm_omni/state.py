"""Rollout state of a vLLM-Omni OmniModel's stages, from its live Deployments and pods."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from omnimodel_operator import conditions as cond
from omnimodel_operator import naming
from omnimodel_operator.builders.vllm_omni import head_selector, replica_deployment_name
from omnimodel_operator.status import ComponentState, combine, component_state
from omnimodel_operator.vllm_omni.membership import ANNOTATION, Membership, StageMembers
from omnimodel_operator.vllm_omni.plan import VllmPlan
from omnimodel_operator.vllm_omni.restarts import is_replica_pod

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
    head_deployment = current.get(("Deployment", naming.stage_name(plan.name, plan.head.name)))
    membership = Membership.from_annotation(
        ((head_deployment or {}).get("metadata", {}).get("annotations") or {}).get(ANNOTATION)
    )
    stages = []
    for sp in plan.stages:
        mine = [p for p in pods if _matches(p, naming.stage_selector(plan.name, sp.name))]
        replicas = current.get(("Deployment", replica_deployment_name(plan, sp)))
        part = component_state(sp.name, replicas, mine)
        if membership is not None and head.is_ready:
            part = registered_only(part, mine, membership.stages.get(sp.name, StageMembers()))
        if sp.stage.id == plan.head.stage.id:
            stages.append(combine(sp.name, [head] + ([part] if (sp.replicas or 1) > 1 else [])))
        else:
            stages.append(part)
    gateway = component_state(
        "gateway", current.get(("Deployment", naming.stage_name(plan.name, plan.head.name))), head_pods
    )
    return stages, gateway


def registered_only(state: ComponentState, pods: Sequence[Manifest], members: StageMembers) -> ComponentState:
    """A ready replica pod counts only when the head has it registered (its probes say the same where the
    kubelet runs them). One the head detached while it runs is lost capacity (Degraded names the stage),
    whether or not its readiness probe has already taken it out; one not registered yet is still starting."""
    running = [p for p in pods if is_replica_pod(p) and not p["metadata"].get("deletionTimestamp")]
    lost = [p for p in running if _ip(p) in members.lost]
    # The head's own replica is the head: only replica pods need the head's word.
    unregistered = [p for p in running if _pod_ready(p) and _ip(p) not in members.registered]
    if not unregistered and not lost:
        return state
    n = len(unregistered)
    messages = [state.message] if state.message else []
    if lost:
        messages.append(f"{state.name}: {len(lost)} replica(s) detached by the vLLM-Omni head: {_names(lost)}")
    starting = [p for p in unregistered if p not in lost]
    if starting:
        messages.append(
            f"{state.name}: {len(starting)} replica(s) not registered with the vLLM-Omni head yet: {_names(starting)}"
        )
    return dataclasses.replace(
        state,
        ready=max(state.ready - n, 0),
        available=max(state.available - n, 0),
        reason=cond.PODS_NOT_READY if lost else (state.reason or cond.UPDATING),
        message="; ".join(messages),
        degraded=state.degraded or bool(lost),
    )


def _ip(pod: Mapping[str, Any]) -> str | None:
    return (pod.get("status") or {}).get("podIP")


def _names(pods: Sequence[Manifest]) -> str:
    return ", ".join(sorted(p["metadata"]["name"] for p in pods))


def _pod_ready(pod: Mapping[str, Any]) -> bool:
    if pod["metadata"].get("deletionTimestamp"):
        return False
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
