"""Children of an OmniModel running vLLM-Omni's own engines (``runtime.kind: vllm-omni``).

- ConfigMap ``<cr>-pipeline``: the deploy file every pod passes to ``--deploy-config`` (the bundled
  config as vLLM-Omni resolves it, with each stage's engineArgs, per-pod devices and, for edges whose
  bundled connector is shared memory, a network connector).
- The head: Deployment ``<cr>-<entry stage>`` (one pod: vLLM-Omni's API server, orchestrator and replica
  0 of the entry stage), Service ``<cr>-gateway`` (the OpenAI API, ``status.endpoint``) and headless
  Service ``<cr>-master`` (the address replicas register with; not-ready addresses published, because
  the head is not ready until they have).
- Every other stage, and extra replicas of the entry stage: a Deployment of headless replicas.
- A ``mooncake_master`` Deployment + Service when the network connector is in use.
- NetworkPolicies: the OmniModel's pods reach each other on any port (the head opens a port per replica
  slot; Mooncake moves data pod to pod); clients reach only the head's API port.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from importlib import resources
from typing import Any, Final

import yaml

from omnimodel_operator import constants as C
from omnimodel_operator import naming
from omnimodel_operator.accelerators import accelerator_for
from omnimodel_operator.builders.common import (
    Manifest,
    container_security_context,
    content_hash,
    dedupe,
    env_list,
    merge_env,
    metadata,
    model_cache_volume,
    model_source_volume,
    pod_identity,
    pod_security_context,
    resources_dict,
    runtime_env,
    scratch_volumes,
    service_account,
    stage_requests,
    stage_resources,
    tolerations_list,
)
from omnimodel_operator.builders.weights import OFFLINE_ENV, fetch_job, fetches, wait_weights_container, weights_claim
from omnimodel_operator.settings import OperatorSettings
from omnimodel_operator.vllm_omni.plan import (
    API_PORT,
    DEPLOY_FILE,
    FETCH_STAGE,
    MASTER_PORT,
    MOONCAKE_METADATA_PORT,
    MOONCAKE_RPC_PORT,
    OVERLAY_FILE,
    VllmPlan,
    VllmStagePlan,
)
from omnimodel_operator.vllm_omni.restarts import RestartMarks, is_head_pod, is_replica_pod, restart_marks
from omnimodel_runtime.pipeline import Vendor

COMPONENT_HEAD: Final = "head"
COMPONENT_MOONCAKE: Final = "mooncake"
DEPLOY_DIR: Final = C.PIPELINE_MOUNT_DIR
# Loading real weights can take many minutes, and the head then waits up to vLLM-Omni's
# stage-init-timeout for every stage's first replica.
STARTUP_SECONDS: Final = 1800
API_KEY_SECRET_KEY: Final = "api-key"  # noqa: S105  (the name of a Secret key, not a secret)
# Shipped beside the deploy file (vllm_omni/podfiles): the head's membership and drain endpoints, loaded by
# Python from PYTHONPATH, and the replicas' probe and preStop, which ask the head about their own pod IP.
SHIM_FILE: Final = "sitecustomize.py"
PROBE_FILE: Final = "omnimodel_probe.py"
# A replica's preStop waits at most this long for its requests to finish (then SIGTERM detaches it); the
# grace period covers it and vLLM-Omni's own shutdown.
DRAIN_SECONDS: Final = 30
TERMINATION_GRACE_SECONDS: Final = 90
# /dev/shm of a vLLM-Omni pod: vLLM's processes exchange through it (the broadcast queue of a
# tensor-parallel group, tensors passed between processes) and NCCL uses it between a pod's GPUs. A memory
# emptyDir without a size could grow to the whole pod's memory; this is 1 GiB plus 1 GiB per device.
SHM_BASE_GIB: Final = 1
SHM_PER_DEVICE_GIB: Final = 1

# The head's liveness probe for configs whose entry stage answers text: /health, then a one-token, text-only
# chat through the orchestrator. vLLM-Omni 0.30.0's /health stays 200 when the orchestrator is wedged (a
# replica that died mid-request can block it), so only a real request tells; a text-only one touches the
# entry stage alone (without `modalities` it takes the config's default outputs: for Qwen2.5-Omni it ran
# through the talker, failing 500 "Stage-1 has no live replica" with the talker detached). /health covers
# the later stages: 503 while one has no live replica. That state does not heal: 0.30.0 never re-attaches a
# replica it detached, even one that only stalled past its 30 s heartbeat timeout and then resumed (e2e
# test_vllm_omni_operator); a new head process does, since restarts.py then restarts the replicas. urlopen
# raises on a 503, so the probe fails.
_CANARY: Final = """import json, os, sys, urllib.request
base = "http://127.0.0.1:%s" % os.environ["OMNIMODEL_API_PORT"]
urllib.request.urlopen(base + "/health", timeout=5)
body = json.dumps({"model": os.environ["OMNIMODEL_SERVED_NAME"], "max_tokens": 1, "modalities": ["text"],
                   "messages": [{"role": "user", "content": "ping"}]}).encode()
req = urllib.request.Request(base + "/v1/chat/completions",
                             body, {"Content-Type": "application/json",
                                    "Authorization": "Bearer " + os.environ.get("VLLM_API_KEY", "x")})
sys.exit(0 if urllib.request.urlopen(req, timeout=20).status == 200 else 1)
"""


def head_labels(plan: VllmPlan) -> dict[str, str]:
    return {**naming.common_labels(plan.name, COMPONENT_HEAD), C.LABEL_STAGE: plan.head.name}


def head_selector(plan: VllmPlan) -> dict[str, str]:
    return {C.LABEL_INSTANCE: naming.instance_label(plan.name), C.LABEL_COMPONENT: COMPONENT_HEAD}


def master_host(plan: VllmPlan) -> str:
    return f"{naming.dns_label(plan.name, 'master')}.{plan.namespace}.svc"


def head_deployment_name(plan: VllmPlan) -> str:
    return naming.stage_name(plan.name, plan.head.name)


def replica_deployment_name(plan: VllmPlan, sp: VllmStagePlan) -> str:
    """The head's stage keeps ``<cr>-<stage>`` for the head; its extra replicas get their own name."""
    if sp.stage.id == plan.head.stage.id:
        return naming.dns_label(plan.name, sp.name, "replicas")
    return naming.stage_name(plan.name, sp.name)


def deploy_configmap(plan: VllmPlan) -> Manifest:
    if plan.deploy is None:
        text = f"# OmniModel {plan.namespace}/{plan.name} runs its model's own single stage: no deploy config.\n"
    else:
        text = (
            f"# Rendered by the omnimodel operator from vLLM-Omni {plan.config.name}.yaml "
            f"({plan.config.file}) for OmniModel {plan.namespace}/{plan.name}.\n"
            + yaml.safe_dump(plan.deploy, sort_keys=False, width=120)
        )
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(
            plan, naming.pipeline_configmap_name(plan.name), naming.common_labels(plan.name, C.COMPONENT_PIPELINE)
        ),
        "data": {
            DEPLOY_FILE: text,
            SHIM_FILE: _podfile(SHIM_FILE),
            PROBE_FILE: _podfile(PROBE_FILE),
            # What the weights fetch and each pod's wait for it read (builders/weights.py).
            **({C.PIPELINE_FILE_KEY: plan.pipeline.to_json()} if fetches(plan) else {}),
        },
    }


def _podfile(name: str) -> str:
    return resources.files("omnimodel_operator.vllm_omni.podfiles").joinpath(name).read_text()


def _deploy_volume(plan: VllmPlan) -> tuple[dict[str, Any], dict[str, Any]]:
    mount = {"name": "deploy", "mountPath": DEPLOY_DIR, "readOnly": True}
    keys = (DEPLOY_FILE, SHIM_FILE, PROBE_FILE, *((C.PIPELINE_FILE_KEY,) if fetches(plan) else ()))
    items = [{"key": key, "path": key} for key in keys]
    ours = {"name": naming.pipeline_configmap_name(plan.name), "items": items}
    ref = plan.spec.runtime.deploy_config_ref
    if ref is None:
        return {"name": "deploy", "configMap": ours}, mount
    theirs = {"name": ref.name, "items": [{"key": ref.key, "path": OVERLAY_FILE}]}
    return {"name": "deploy", "projected": {"sources": [{"configMap": ours}, {"configMap": theirs}]}}, mount


def _deploy_path(plan: VllmPlan) -> str:
    # A deployConfigRef overlay names deploy.yaml as its base_config; vLLM-Omni merges the two.
    return f"{DEPLOY_DIR}/{OVERLAY_FILE if plan.spec.runtime.deploy_config_ref else DEPLOY_FILE}"


def _common_args(plan: VllmPlan, sp: VllmStagePlan) -> list[str]:
    extra = list(plan.spec.runtime.extra_args or ())
    if plan.deploy is None:
        # Only what differs from vLLM-Omni's own defaults for the stage (one device, one replica): an
        # override replaces the stage's engine settings built from the command line (--dtype included).
        stage = {k: v for k, v in sp.deploy.items() if k not in ("stage_id", "num_replicas")}
        if stage.get("devices") == "0":
            del stage["devices"]
        overrides = json.dumps({str(sp.stage.id): stage}, sort_keys=True)
        config = ["--stage-overrides", overrides] if stage else []
    else:
        config = ["--deploy-config", _deploy_path(plan)]
    model = plan.spec.model
    # Offline pods find a branch in the cache by the ref the fetch wrote; a revision is never implied.
    revision = ["--revision", model.revision] if model.revision and model.source.startswith("hf://") else []
    return [plan.model, "--omni", *config, *revision, "--stage-id", str(sp.stage.id), *extra]


def _env(plan: VllmPlan, sp: VllmStagePlan, settings: OperatorSettings) -> list[dict[str, Any]]:
    acc = accelerator_for(sp.accelerator.vendor)
    model = plan.spec.model
    # A fetched model is read from the cache with the Hub offline. Without a cache each pod downloads hf://
    # weights itself, from the mirror if one is named (the spec refuses a token without a cache: only the
    # fetch Job ever gets it).
    hub: list[dict[str, Any]] = [{"name": "HF_ENDPOINT", "value": model.endpoint}] if model.endpoint else []
    if fetches(plan):
        hub = list(OFFLINE_ENV)
    return merge_env(
        runtime_env(plan),
        hub,
        [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            # sitecustomize.py of the mounted ConfigMap: the head's /omnimodel/replicas and /omnimodel/drain.
            {"name": "PYTHONPATH", "value": DEPLOY_DIR},
        ],
        [{"name": k, "value": v} for k, v in acc.env().items()],
        [{"name": k, "value": v} for k, v in settings.vllm_omni_env.items()],
        env_list(sp.spec.env if sp.spec else None),
    )


def _pod(
    plan: VllmPlan,
    sp: VllmStagePlan | None,
    container: dict[str, Any],
    settings: OperatorSettings,
    extra_volumes: list[dict[str, Any]],
    init_containers: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    acc_request = sp.accelerator if sp is not None else None
    acc = accelerator_for(acc_request.vendor if acc_request is not None else Vendor.CPU)
    user = sp.spec if sp is not None else None
    pod: dict[str, Any] = {
        **pod_identity(plan),
        "securityContext": pod_security_context(),
        **({"initContainers": init_containers} if init_containers else {}),
        "containers": [container],
        "volumes": extra_volumes,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
    }
    node_selector = {
        **(acc.node_selector(acc_request) if acc_request is not None else {}),
        **((user.node_selector if user else None) or {}),
    }
    tolerations = dedupe([*acc.tolerations(), *tolerations_list(user.tolerations if user else None)])
    if node_selector:
        pod["nodeSelector"] = dict(sorted(node_selector.items()))
    if tolerations:
        pod["tolerations"] = tolerations
    if user is not None and user.affinity:
        pod["affinity"] = user.affinity
    return pod


def _engine_container(
    plan: VllmPlan,
    sp: VllmStagePlan,
    args: list[str],
    settings: OperatorSettings,
    *,
    head: bool,
    weights_bytes: int | None,
) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    """The engine container, the pod's volumes and its init containers (the wait for fetched weights)."""
    deploy_vol, deploy_mount = _deploy_volume(plan)
    own = sp.spec.resources if sp.spec else None
    init: list[dict[str, Any]] = []
    cache_vol, cache_mount = model_cache_volume(plan, read_only=fetches(plan))
    if fetches(plan):
        # The wait runs from the runtime image (vLLM-Omni's has no `omnimodel`) with the stage's CPU and
        # memory, not its devices, as the omnimodel runtime's stages do (builders/stage.py).
        wait = resources_dict(own, stage_requests(settings, sp.accelerator), settings.limit_ratios)
        init = [wait_weights_container(settings.cpu_runtime_image, FETCH_STAGE, wait, [deploy_mount, cache_mount])]
    scratch_vols, scratch_mounts = scratch_volumes()
    devices = sp.accelerator.count if accelerator_for(sp.accelerator.vendor).resource_name else 0
    shm = f"{SHM_BASE_GIB + SHM_PER_DEVICE_GIB * devices}Gi"
    scratch_vols = [{**v, "emptyDir": {**v["emptyDir"], "sizeLimit": shm}} if v["name"] == "dshm" else v
                    for v in scratch_vols]  # fmt: skip
    source = model_source_volume(plan)
    source_vols, source_mounts = ([source[0]], [source[1]]) if source else ([], [])
    env = _env(plan, sp, settings)
    container: dict[str, Any] = {
        "name": "vllm-omni",
        "image": sp.image,
        "imagePullPolicy": plan.spec.runtime.image_pull_policy or settings.image_pull_policy,
        "command": ["vllm", "serve"],
        "args": args,
        "env": env,
        "resources": stage_resources(own, sp.accelerator, settings, weights_bytes),
        "volumeMounts": [deploy_mount, cache_mount, *source_mounts, *scratch_mounts],
        "securityContext": container_security_context(),
    }
    if head:
        gw = plan.spec.gateway
        container["ports"] = [
            {"name": "http", "containerPort": API_PORT, "protocol": "TCP"},
            {"name": "master", "containerPort": MASTER_PORT, "protocol": "TCP"},
        ]
        env.extend(
            [
                {"name": "OMNIMODEL_SERVED_NAME", "value": plan.served_name},
                {"name": "OMNIMODEL_API_PORT", "value": str(API_PORT)},
            ]
        )
        if gw.api_key_secret:
            env.append(
                {
                    "name": "VLLM_API_KEY",
                    "valueFrom": {"secretKeyRef": {"name": gw.api_key_secret, "key": API_KEY_SECRET_KEY}},
                }
            )
        container.update(_head_probes(plan))
    else:
        env.extend(
            [
                {"name": "OMNIMODEL_STAGE_ID", "value": str(sp.stage.id)},
                {"name": "OMNIMODEL_HEAD_URL", "value": f"http://{master_host(plan)}:{API_PORT}"},
                {"name": "OMNIMODEL_DRAIN_SECONDS", "value": str(DRAIN_SECONDS)},
            ]
        )
        container.update(_replica_probes())
    return container, [deploy_vol, cache_vol, *source_vols, *scratch_vols], init


def _head_probes(plan: VllmPlan) -> dict[str, Any]:
    health = {"httpGet": {"path": C.HEALTH_PATH, "port": "http"}}
    probes: dict[str, Any] = {
        # /health turns 200 once every stage has a live replica (vLLM-Omni checks it), so readiness
        # means "the whole graph serves", not only "the API server is up".
        # Every second, as our own runtime's stages (common.http_probes): an HTTP GET is cheap, and the
        # startup period is what delays Ready. The replicas' exec probes start a python each time: 5 s.
        "startupProbe": {**health, "periodSeconds": 1, "failureThreshold": STARTUP_SECONDS},
        "readinessProbe": {**health, "periodSeconds": 5, "failureThreshold": 2},
    }
    if plan.head.stage.final_output and plan.head.stage.final_output_type == "text":
        probes["livenessProbe"] = {
            "exec": {"command": ["python3", "-c", _CANARY]},
            "periodSeconds": 30,
            "timeoutSeconds": 25,
            "failureThreshold": 3,
        }
    else:
        probes["livenessProbe"] = {**health, "periodSeconds": 10, "failureThreshold": 3}
    return probes


def _replica_probes() -> dict[str, Any]:
    """A replica serves only through the head, so each probe asks the head about this pod
    (podfiles/omnimodel_probe.py): started = attached by a head that answers; ready = registered,
    heartbeat current, not draining; live = registered, or the head does not answer (0.30 never takes
    back a replica it detached, nor does a new head process take the old replicas: a restarted container
    registers anew). preStop drains it before SIGTERM detaches it."""

    def probe(mode: str) -> dict[str, Any]:
        return {"exec": {"command": ["python3", f"{DEPLOY_DIR}/{PROBE_FILE}", mode]}, "timeoutSeconds": 10}

    return {
        # Loading weights, then registering: the head's own start-up can take as long.
        "startupProbe": {**probe("started"), "periodSeconds": 5, "failureThreshold": STARTUP_SECONDS // 5},
        "readinessProbe": {**probe("ready"), "periodSeconds": 5, "failureThreshold": 1},
        # Three misses: a head restarting (its API is down until every stage has a replica) restarts the
        # replicas, which is what 0.30 needs for them to register with the new head process.
        "livenessProbe": {**probe("live"), "periodSeconds": 10, "failureThreshold": 3},
        "lifecycle": {"preStop": {"exec": {"command": ["python3", f"{DEPLOY_DIR}/{PROBE_FILE}", "drain"]}}},
    }


def _deployment(
    plan: VllmPlan,
    name: str,
    labels: dict[str, str],
    selector: dict[str, str],
    pod: dict[str, Any],
    replicas: int | None,
    template_annotations: dict[str, str],
    *,
    recreate: bool,
    annotations: dict[str, str] | None = None,
) -> Manifest:
    spec: dict[str, Any] = {
        "selector": {"matchLabels": selector},
        "template": {"metadata": {"labels": labels, "annotations": template_annotations}, "spec": pod},
        # A second head beside the first would split the replicas between two orchestrators.
        "strategy": {"type": "Recreate"}
        if recreate
        else {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
        "revisionHistoryLimit": 3,
    }
    if replicas is not None:
        spec["replicas"] = replicas
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(plan, name, labels, annotations),
        "spec": spec,
    }


def _annotations(plan: VllmPlan, restart: dict[str, str]) -> dict[str, str]:
    return {C.ANNOTATION_PIPELINE_HASH: content_hash(plan.deploy), **restart}


def head_deployment(
    plan: VllmPlan, settings: OperatorSettings, marks: RestartMarks, weights_bytes: int | None = None
) -> Manifest:
    sp = plan.head
    args = [
        *_common_args(plan, sp),
        "--omni-master-address", "$(POD_IP)",
        "--omni-master-port", str(MASTER_PORT),
        "--host", "0.0.0.0",
        "--port", str(API_PORT),
        "--served-model-name", plan.served_name,
    ]  # fmt: skip
    container, volumes, init = _engine_container(plan, sp, args, settings, head=True, weights_bytes=weights_bytes)
    pod = _pod(plan, sp, container, settings, volumes, init)
    return _deployment(
        plan, naming.stage_name(plan.name, sp.name), head_labels(plan), head_selector(plan), pod, 1,
        _annotations(plan, marks.head_template), recreate=True, annotations=marks.head_metadata,
    )  # fmt: skip


def replica_deployment(
    plan: VllmPlan,
    sp: VllmStagePlan,
    settings: OperatorSettings,
    marks: RestartMarks,
    weights_bytes: int | None = None,
) -> Manifest | None:
    """Headless replicas of one stage; None for the entry stage when the head is its only replica."""
    is_head_stage = sp.stage.id == plan.head.stage.id
    replicas = sp.replicas
    if is_head_stage:
        replicas = (replicas or 1) - 1
        if replicas == 0:
            return None
    args = [
        *_common_args(plan, sp),
        "--headless",
        "--omni-master-address", master_host(plan),
        "--omni-master-port", str(MASTER_PORT),
        "--omni-replica-address", "$(POD_IP)",
    ]  # fmt: skip
    container, volumes, init = _engine_container(plan, sp, args, settings, head=False, weights_bytes=weights_bytes)
    pod = _pod(plan, sp, container, settings, volumes, init)
    labels = naming.stage_labels(plan.name, sp.name)
    return _deployment(
        plan, replica_deployment_name(plan, sp), labels, naming.stage_selector(plan.name, sp.name), pod, replicas,
        _annotations(plan, marks.replica_template), recreate=False, annotations=marks.replica_metadata,
    )  # fmt: skip


def api_service(plan: VllmPlan) -> Manifest:
    gw = plan.spec.gateway
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(plan, naming.gateway_name(plan.name), head_labels(plan)),
        "spec": {
            "type": gw.service_type,
            "selector": head_selector(plan),
            "ports": [{"name": "http", "port": gw.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def master_service(plan: VllmPlan) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(plan, naming.dns_label(plan.name, "master"), head_labels(plan)),
        "spec": {
            "clusterIP": "None",
            # Replicas must find the head before it is ready: it is ready only once they registered.
            "publishNotReadyAddresses": True,
            "selector": head_selector(plan),
            "ports": [{"name": "master", "port": MASTER_PORT, "targetPort": "master", "protocol": "TCP"}],
        },
    }


def mooncake(plan: VllmPlan, settings: OperatorSettings) -> list[Manifest]:
    """The metadata server and master of the network connector (CPU only; state in memory)."""
    name = naming.dns_label(plan.name, COMPONENT_MOONCAKE)
    labels = naming.common_labels(plan.name, COMPONENT_MOONCAKE)
    selector = {C.LABEL_INSTANCE: naming.instance_label(plan.name), C.LABEL_COMPONENT: COMPONENT_MOONCAKE}
    container: dict[str, Any] = {
        "name": "mooncake-master",
        "image": plan.spec.runtime.image or settings.vllm_omni_image(Vendor.NVIDIA),
        "imagePullPolicy": plan.spec.runtime.image_pull_policy or settings.image_pull_policy,
        "command": ["mooncake_master"],
        "args": [
            "-rpc_address",
            "$(POD_IP)",
            "-rpc_port",
            str(MOONCAKE_RPC_PORT),
            "-enable_http_metadata_server=true",
            "-http_metadata_server_host",
            "$(POD_IP)",
            "-http_metadata_server_port",
            str(MOONCAKE_METADATA_PORT),
        ],
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "ports": [
            {"name": "rpc", "containerPort": MOONCAKE_RPC_PORT, "protocol": "TCP"},
            {"name": "metadata", "containerPort": MOONCAKE_METADATA_PORT, "protocol": "TCP"},
        ],
        "resources": resources_dict(None, settings.gateway_requests, settings.limit_ratios),
        "securityContext": container_security_context(),
        "readinessProbe": {"tcpSocket": {"port": "rpc"}, "periodSeconds": 5},
    }
    pod = _pod(plan, None, container, settings, [])
    deployment = _deployment(plan, name, labels, selector, pod, 1, {}, recreate=True)
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(plan, name, labels),
        "spec": {
            "selector": selector,
            "ports": [
                {"name": "rpc", "port": MOONCAKE_RPC_PORT, "targetPort": "rpc", "protocol": "TCP"},
                {"name": "metadata", "port": MOONCAKE_METADATA_PORT, "targetPort": "metadata", "protocol": "TCP"},
            ],
        },
    }
    return [service, deployment]


def network_policies(plan: VllmPlan, settings: OperatorSettings) -> list[Manifest]:
    instance = {C.LABEL_INSTANCE: naming.instance_label(plan.name)}
    peers: list[dict[str, Any]] = [{"podSelector": {"matchLabels": instance}}]
    if settings.scrape_from:
        peers.append(dict(settings.scrape_from))
    internal = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(
            plan, naming.dns_label(plan.name, C.COMPONENT_RUNTIME), naming.common_labels(plan.name, C.COMPONENT_RUNTIME)
        ),
        "spec": {"podSelector": {"matchLabels": instance}, "policyTypes": ["Ingress"], "ingress": [{"from": peers}]},
    }
    api = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(plan, naming.gateway_name(plan.name), head_labels(plan)),
        "spec": {
            "podSelector": {"matchLabels": head_selector(plan)},
            "policyTypes": ["Ingress"],
            "ingress": [{"ports": [{"protocol": "TCP", "port": API_PORT}]}],
        },
    }
    return [internal, api]


def render_vllm_omni(
    plan: VllmPlan, settings: OperatorSettings, marks: RestartMarks, stage_bytes: Mapping[str, int] | None = None
) -> list[Manifest]:
    """Every child, in apply order (the deploy file before the pods that mount it). ``stage_bytes``: the
    fetch's sizes once known; every stage opens the whole model directory, so each CPU stage is sized by
    the whole fetch (its one file set, ``FETCH_STAGE``)."""
    weights_bytes = (stage_bytes or {}).get(FETCH_STAGE)
    out: list[Manifest] = [deploy_configmap(plan), service_account(plan)]
    # The weights, fetched once into the cache claim by the runtime image (vLLM-Omni's has no fetcher).
    fetch = (weights_claim(plan), fetch_job(plan, settings, settings.cpu_runtime_image))
    out.extend(m for m in fetch if m is not None)
    if plan.network_edges:
        out.extend(mooncake(plan, settings))
    out.extend([master_service(plan), api_service(plan), head_deployment(plan, settings, marks, weights_bytes)])
    for sp in plan.stages:
        replica = replica_deployment(plan, sp, settings, marks, weights_bytes)
        if replica is not None:
            out.append(replica)
    if settings.network_policy:
        out.extend(network_policies(plan, settings))
    return out


def restart_marks_of(plan: VllmPlan, observed: Any) -> RestartMarks:
    """The restart bookkeeping for this pass, from what is live (nothing live: a fresh start)."""
    if observed is None:
        return RestartMarks()
    objects = observed.objects
    head = objects.get(("Deployment", naming.stage_name(plan.name, plan.head.name)))
    replicas = [objects.get(("Deployment", replica_deployment_name(plan, sp))) for sp in plan.stages]
    return restart_marks(
        head,
        replicas,
        [p for p in observed.pods if is_head_pod(p)],
        [p for p in observed.pods if is_replica_pod(p)],
    )


__all__ = ["render_vllm_omni", "restart_marks_of"]
