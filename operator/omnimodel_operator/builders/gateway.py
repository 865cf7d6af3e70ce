"""The gateway: OpenAI-compatible API in front of the stage graph."""

from __future__ import annotations

import json
from typing import Any

from omnimodel_operator import constants as C
from omnimodel_operator import naming
from omnimodel_operator.accelerators import accelerator_for
from omnimodel_operator.builders.common import (
    Manifest,
    content_hash,
    merge_env,
    metadata,
    pipeline_volume,
    pod_identity,
    pod_security_context,
    resources_dict,
    runtime_container,
    runtime_env,
    scratch_volumes,
    tolerations_list,
)
from omnimodel_operator.resolve import Plan
from omnimodel_operator.settings import OperatorSettings
from omnimodel_runtime.pipeline import Vendor

API_KEY_SECRET_KEY = "api-key"  # noqa: S105  (the name of a Secret key, not a secret)
GATEWAY_STARTUP_SECONDS = 300


def gateway_deployment(plan: Plan, settings: OperatorSettings) -> Manifest:
    gw = plan.spec.gateway
    name = naming.gateway_name(plan.name)
    labels = naming.gateway_labels(plan.name)
    pipeline_vol, pipeline_mount = pipeline_volume(plan)
    scratch_vols, scratch_mounts = scratch_volumes()
    env = merge_env(runtime_env(plan), [{"name": k, "value": v} for k, v in accelerator_for(Vendor.CPU).env().items()])
    if wake := plan.wake_timeouts():
        # Stages that may sit at zero: the gateway holds their requests (and says so in its metrics,
        # which is what wakes them) instead of answering 503 at once.
        env = merge_env(env, [{"name": "OMNIMODEL_STAGE_WAKE", "value": json.dumps(wake, sort_keys=True)}])
    if gw.api_key_secret:
        env.append(
            {
                "name": "OMNIMODEL_API_KEY",
                "valueFrom": {"secretKeyRef": {"name": gw.api_key_secret, "key": API_KEY_SECRET_KEY}},
            }
        )
    container = runtime_container(
        "gateway",
        "gateway",
        C.GATEWAY_PORT,
        image=plan.gateway_image,
        pull_policy=plan.spec.runtime.image_pull_policy or settings.image_pull_policy,
        env=env,
        resources=resources_dict(gw.resources, settings.gateway_requests, settings.limit_ratios),
        mounts=[pipeline_mount, *scratch_mounts],
        startup_seconds=GATEWAY_STARTUP_SECONDS,
    )
    pod_spec: dict[str, Any] = {
        **pod_identity(plan),
        "securityContext": pod_security_context(),
        "containers": [container],
        "volumes": [pipeline_vol, *scratch_vols],
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 60,
    }
    if gw.node_selector:
        pod_spec["nodeSelector"] = dict(sorted(gw.node_selector.items()))
    if gw.tolerations:
        pod_spec["tolerations"] = tolerations_list(gw.tolerations)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(plan, name, labels),
        "spec": {
            "replicas": gw.replicas,
            "selector": {"matchLabels": naming.gateway_selector(plan.name)},
            "template": {
                "metadata": {
                    "labels": labels,
                    # The gateway reads the whole graph (routes, endpoints), so any change rolls it.
                    "annotations": {C.ANNOTATION_PIPELINE_HASH: content_hash(plan.pipeline.to_json())},
                },
                "spec": pod_spec,
            },
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "revisionHistoryLimit": 3,
        },
    }


def gateway_service(plan: Plan) -> Manifest:
    gw = plan.spec.gateway
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(plan, naming.gateway_name(plan.name), naming.gateway_labels(plan.name)),
        "spec": {
            "type": gw.service_type,
            "selector": naming.gateway_selector(plan.name),
            "ports": [{"name": "http", "port": gw.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }
