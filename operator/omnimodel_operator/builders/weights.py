"""Weights for ``hf://`` models with a cache: one fetch Job per model revision into a shared claim.

The Job runs ``omnimodel fetch`` (the only container that gets the token, ``model.tokenSecret``): it
downloads the union of the stages' files (``Stage.files``, from the presets) into the claim in
huggingface_hub's cache layout and writes a completion marker. Stage pods mount the claim read-only,
wait for the marker in an init container (``omnimodel wait-weights``) instead of downloading, and run
with the Hub offline. The Job's name carries a hash of what it fetches, so a changed revision is a new
Job (the old one is pruned) and the stages roll (their template carries the same hash).
"""

from __future__ import annotations

from typing import Any, Final, Protocol

from omnimodel_operator import constants as C
from omnimodel_operator import naming
from omnimodel_operator.builders.common import (
    Manifest,
    Plan,
    cache_claim_name,
    container_security_context,
    content_hash,
    metadata,
    model_cache_volume,
    pipeline_volume,
    pod_identity,
    pod_security_context,
    resources_dict,
    scratch_volumes,
)
from omnimodel_operator.resolve import StagePlan
from omnimodel_operator.settings import OperatorSettings
from omnimodel_runtime.pipeline import Pipeline

COMPONENT_FETCH: Final = "fetch"
PROGRESS_PORT: Final = 8002
HUB_CACHE: Final = f"{C.MODEL_CACHE_DIR}/hf/hub"  # HF_HOME=/models/hf (runtime_env) -> its hub cache
DEFAULT_CLAIM_SIZE: Final = "100Gi"
DEFAULT_ACCESS_MODE: Final = "ReadWriteMany"
# `omnimodel fetch` exits 3 when a retry cannot help (rejected token, missing repository, full volume).
EXIT_PERMANENT: Final = 3
# Retries of a fetch that failed for a reason that may pass (network, 429, 5xx).
FETCH_BACKOFF_LIMIT: Final = 3


class FetchPlan(Plan, Protocol):
    """A plan whose weights can be fetched: both runtimes' plans (vLLM-Omni's has one ``model`` stage)."""

    @property
    def pipeline(self) -> Pipeline: ...


def fetches(plan: Plan) -> bool:
    """Whether this OmniModel's weights are fetched once: an hf:// source and a cache to fetch into."""
    return plan.spec.model.source.startswith("hf://") and plan.spec.model.cache is not None


def weights_key(plan: FetchPlan) -> str:
    """What the fetch fetches: the source, revision, endpoint and every stage's file set. A change to
    any of them is a new Job (and a roll of the stages, whose pod templates carry it)."""
    model = plan.spec.model
    files = {s.name: s.files.model_dump(mode="json") if s.files else None for s in plan.pipeline.stages}
    return content_hash(
        {"source": model.source, "revision": model.revision, "endpoint": model.endpoint, "files": files}
    )


def job_name(plan: FetchPlan) -> str:
    return naming.dns_label(plan.name, "fetch", weights_key(plan)[:10])


def weights_claim(plan: Plan) -> Manifest | None:
    """The claim the operator creates when the spec names a StorageClass (not an existing claim)."""
    cache = plan.spec.model.cache
    claim = cache_claim_name(plan)
    if cache is None or cache.storage_class_name is None or claim is None:
        return None
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": metadata(plan, claim, naming.common_labels(plan.name, "models")),
        "spec": {
            "storageClassName": cache.storage_class_name,
            "accessModes": [cache.access_mode or DEFAULT_ACCESS_MODE],
            "resources": {"requests": {"storage": str(cache.size or DEFAULT_CLAIM_SIZE)}},
        },
    }


def fetch_job(plan: FetchPlan, settings: OperatorSettings, image: str | None = None) -> Manifest | None:
    """The one Job that downloads what every stage needs into the cache claim, run from ``image`` (default:
    the CR's runtime image, else the CPU runtime image; it needs the ``omnimodel`` command)."""
    if not fetches(plan):
        return None
    model = plan.spec.model
    labels = naming.common_labels(plan.name, COMPONENT_FETCH)
    pipeline_vol, pipeline_mount = pipeline_volume(plan)
    cache_vol, cache_mount = model_cache_volume(plan)
    scratch_vols, scratch_mounts = scratch_volumes()
    env: list[dict[str, Any]] = [
        {"name": "HF_HOME", "value": f"{C.MODEL_CACHE_DIR}/hf"},
        {"name": "HOME", "value": "/tmp"},
        {"name": "XDG_CACHE_HOME", "value": "/tmp/.cache"},
    ]
    if model.endpoint:
        env.append({"name": "HF_ENDPOINT", "value": model.endpoint})
    if model.token_secret is not None:
        ref = {"name": model.token_secret.name, "key": model.token_secret.key}
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": ref}})
    container: dict[str, Any] = {
        "name": "fetch",
        "image": image or plan.spec.runtime.image or settings.cpu_runtime_image,
        "imagePullPolicy": plan.spec.runtime.image_pull_policy or settings.image_pull_policy,
        "command": ["omnimodel", "fetch"],
        "args": [
            *("--pipeline", C.PIPELINE_PATH),
            *("--cache-dir", HUB_CACHE),
            *("--progress-host", "0.0.0.0"),
            *("--progress-port", str(PROGRESS_PORT)),
            *("--termination-log", "/dev/termination-log"),
        ],
        "env": env,
        "ports": [{"name": "progress", "containerPort": PROGRESS_PORT, "protocol": "TCP"}],
        "resources": resources_dict(None, settings.fetch_requests, settings.limit_ratios),
        "volumeMounts": [pipeline_mount, cache_mount, *scratch_mounts],
        "securityContext": container_security_context(),
        # The one-line outcome ("Complete: ...", "Unauthorized: ...") is what WeightsReady shows; a
        # crash before it is written leaves the log's tail there instead.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": metadata(plan, job_name(plan), labels),
        "spec": {
            "backoffLimit": FETCH_BACKOFF_LIMIT,
            # A rejected token or a missing repository fails the Job at once: retrying only hides the reason.
            "podFailurePolicy": {
                "rules": [
                    {
                        "action": "FailJob",
                        "onExitCodes": {"containerName": "fetch", "operator": "In", "values": [EXIT_PERMANENT]},
                    }
                ]
            },
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    **pod_identity(plan),
                    "securityContext": pod_security_context(),
                    "restartPolicy": "Never",
                    "containers": [container],
                    "volumes": [pipeline_vol, cache_vol, *scratch_vols],
                    "enableServiceLinks": False,
                },
            },
        },
    }


def stage_weights(
    plan: Plan, sp: StagePlan, resources: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """What a stage pod of a fetched model gets instead of downloading: the claim read-only (volume,
    mount) and an init container, with ``resources``, that waits until the fetch has put the stage's
    files there."""
    volume, mount = model_cache_volume(plan, read_only=True)
    _, pipeline_mount = pipeline_volume(plan)
    return volume, mount, wait_weights_container(sp.image, sp.stage.name, resources, [pipeline_mount, mount])


def wait_weights_container(
    image: str, stage: str, resources: dict[str, Any], mounts: list[dict[str, Any]]
) -> dict[str, Any]:
    """The init container that waits until the fetch has put ``stage``'s files into the cache; ``mounts``
    give it the pipeline file (at ``PIPELINE_PATH``) and the cache."""
    return {
        "name": "wait-weights",
        "image": image,
        "command": ["omnimodel", "wait-weights"],
        "args": ["--pipeline", C.PIPELINE_PATH, "--cache-dir", HUB_CACHE, "--stage", stage],
        "env": [{"name": "HOME", "value": "/tmp"}],
        "resources": resources,
        "volumeMounts": mounts,
        "securityContext": container_security_context(),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


# The Hub stays unreachable from stage pods of a fetched model: every file they read is in the cache.
OFFLINE_ENV: Final = ({"name": "HF_HUB_OFFLINE", "value": "1"},)
