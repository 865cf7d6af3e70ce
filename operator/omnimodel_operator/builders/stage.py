"""Per-stage children: Deployment, headless Service, HPA, PodDisruptionBudget, NetworkPolicy."""

from __future__ import annotations

from typing import Any

from omnimodel_operator import constants as C
from omnimodel_operator import naming
from omnimodel_operator.accelerators import accelerator_for
from omnimodel_operator.builders.common import (
    Manifest,
    content_hash,
    dedupe,
    env_list,
    merge_env,
    metadata,
    model_cache_volume,
    model_source_volume,
    pipeline_volume,
    pod_identity,
    pod_security_context,
    resources_dict,
    runtime_container,
    runtime_env,
    scratch_volumes,
    stage_requests,
    stage_resources,
    tolerations_list,
)
from omnimodel_operator.builders.weights import OFFLINE_ENV, fetches, stage_weights
from omnimodel_operator.resolve import Plan, StagePlan
from omnimodel_operator.settings import OperatorSettings

# Loading real weights (tens of GB) can take many minutes before /health turns 200.
STAGE_STARTUP_SECONDS = 1800


def stage_hash(plan: Plan, sp: StagePlan) -> str:
    """What a stage process reads from the pipeline file: its own stage and the model."""
    return content_hash(
        {"model": plan.pipeline.model.model_dump(mode="json"), "stage": sp.stage.model_dump(mode="json")}
    )


def stage_deployment(
    plan: Plan, sp: StagePlan, settings: OperatorSettings, weights_bytes: int | None = None
) -> Manifest:
    stage = sp.stage
    user = sp.spec
    acc = accelerator_for(stage.accelerator.vendor)
    name = naming.stage_name(plan.name, stage.name)
    selector = naming.stage_selector(plan.name, stage.name)
    labels = naming.stage_labels(plan.name, stage.name)

    node_selector = {**acc.node_selector(stage.accelerator), **((user.node_selector if user else None) or {})}
    tolerations = dedupe([*acc.tolerations(), *tolerations_list(user.tolerations if user else None)])
    pipeline_vol, pipeline_mount = pipeline_volume(plan)
    init_containers: list[dict[str, Any]] = []
    offline: list[dict[str, Any]] = []
    own = user.resources if user else None
    if fetches(plan):
        # The fetch Job downloads; this pod reads the claim and waits for its files. The wait gets the
        # stage's CPU and memory (not its devices): it runs before the stage, so the pod's requests do not
        # grow, and a quota that requires limits admits it too.
        wait = resources_dict(own, stage_requests(settings, stage.accelerator), settings.limit_ratios)
        cache_vol, cache_mount, init = stage_weights(plan, sp, wait)
        init_containers, offline = [init], list(OFFLINE_ENV)
    else:
        cache_vol, cache_mount = model_cache_volume(plan)
    scratch_vols, scratch_mounts = scratch_volumes()
    source = model_source_volume(plan)
    source_vols, source_mounts = ([source[0]], [source[1]]) if source else ([], [])

    container = runtime_container(
        "stage",
        "stage",
        C.STAGE_PORT,
        image=sp.image,
        pull_policy=plan.spec.runtime.image_pull_policy or settings.image_pull_policy,
        args=["--stage", stage.name],
        env=merge_env(
            runtime_env(plan),
            offline,
            [{"name": k, "value": v} for k, v in acc.env().items()],
            env_list(user.env if user else None),
        ),
        resources=stage_resources(own, stage.accelerator, settings, weights_bytes),
        mounts=[pipeline_mount, cache_mount, *source_mounts, *scratch_mounts],
        startup_seconds=STAGE_STARTUP_SECONDS,
    )
    pod_spec: dict[str, Any] = {
        **pod_identity(plan),
        "securityContext": pod_security_context(),
        **({"initContainers": init_containers} if init_containers else {}),
        "containers": [container],
        "volumes": [pipeline_vol, cache_vol, *source_vols, *scratch_vols],
        "enableServiceLinks": False,
        # Drain in-flight generations (the runtime stops accepting, finishes, then exits).
        "terminationGracePeriodSeconds": 60,
    }
    if node_selector:
        pod_spec["nodeSelector"] = dict(sorted(node_selector.items()))
    if tolerations:
        pod_spec["tolerations"] = tolerations
    if user is not None and user.affinity:
        pod_spec["affinity"] = user.affinity

    spec: dict[str, Any] = {
        "selector": {"matchLabels": selector},
        "template": {
            "metadata": {
                "labels": labels,
                "annotations": {C.ANNOTATION_PIPELINE_HASH: stage_hash(plan, sp)},
            },
            "spec": pod_spec,
        },
        # Accelerator pods cannot surge onto devices that are all in use; replace in place instead.
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
        if stage.accelerator.count
        else {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
        "revisionHistoryLimit": 3,
    }
    if sp.replicas is not None:
        spec["replicas"] = sp.replicas
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(plan, name, labels),
        "spec": spec,
    }


def stage_service(plan: Plan, sp: StagePlan) -> Manifest:
    """Headless: the gateway balances per pod (least in-flight), so it needs every pod address,
    not one virtual IP."""
    name = naming.stage_name(plan.name, sp.stage.name)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(plan, name, naming.stage_labels(plan.name, sp.stage.name)),
        "spec": {
            "clusterIP": "None",
            "selector": naming.stage_selector(plan.name, sp.stage.name),
            "ports": [{"name": "http", "port": C.STAGE_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


_METRIC_NAMES = {"queueDepth": "omnimodel_queue_depth", "inFlight": "omnimodel_requests_in_flight"}


def stage_hpa(plan: Plan, sp: StagePlan) -> Manifest | None:
    auto = sp.spec.autoscaling if sp.spec else None
    if auto is None or auto.provider != "hpa":
        # provider operator: the operator's autoscaler sets replicas itself (autoscaler/loop.py).
        return None
    name = naming.stage_name(plan.name, sp.stage.name)
    metric_name = auto.metric or "inFlight"
    target = auto.target_for(metric_name)
    if metric_name == "cpu":
        metric: dict[str, Any] = {
            "type": "Resource",
            "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": round(target)}},
        }
    else:
        metric = {
            "type": "Pods",
            "pods": {
                "metric": {"name": _METRIC_NAMES[metric_name]},
                "target": {"type": "AverageValue", "averageValue": f"{target:g}"},
            },
        }
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": metadata(plan, name, naming.stage_labels(plan.name, sp.stage.name)),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
            "minReplicas": auto.min_replicas,
            "maxReplicas": auto.max_replicas,
            "metrics": [metric],
        },
    }


def stage_pdb(plan: Plan, sp: StagePlan) -> Manifest | None:
    disruption = sp.spec.disruption if sp.spec else None
    if disruption is None:
        return None
    name = naming.stage_name(plan.name, sp.stage.name)
    min_available = disruption.min_available
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(plan, name, naming.stage_labels(plan.name, sp.stage.name)),
        "spec": {
            "minAvailable": min_available,
            "selector": {"matchLabels": naming.stage_selector(plan.name, sp.stage.name)},
        },
    }


def stage_network_policy(plan: Plan, sp: StagePlan, settings: OperatorSettings) -> Manifest:
    """Only this OmniModel's gateway may open connections to a stage: the gateway relays every
    hand-off, stages never call each other. ``scrape_from`` (a monitoring peer) may scrape /metrics."""
    peers: list[dict[str, Any]] = [{"podSelector": {"matchLabels": naming.gateway_selector(plan.name)}}]
    if settings.scrape_from:
        peers.append(dict(settings.scrape_from))
    name = naming.stage_name(plan.name, sp.stage.name)
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(plan, name, naming.stage_labels(plan.name, sp.stage.name)),
        "spec": {
            "podSelector": {"matchLabels": naming.stage_selector(plan.name, sp.stage.name)},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": peers, "ports": [{"protocol": "TCP", "port": C.STAGE_PORT}]}],
        },
    }
