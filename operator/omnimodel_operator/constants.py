"""Names shared by every part of the operator. One place, so builders, reconcile and tests agree."""

from typing import Final

GROUP: Final = "omnimodel.io"
VERSION: Final = "v1alpha1"
API_VERSION: Final = f"{GROUP}/{VERSION}"
KIND: Final = "OmniModel"
PLURAL: Final = "omnimodels"
SINGULAR: Final = "omnimodel"
SHORT_NAMES: Final = ("omni", "om")
CRD_NAME: Final = f"{PLURAL}.{GROUP}"

# Server-side apply field manager; one identity so re-applies are no-ops and conflicts are ours.
FIELD_MANAGER: Final = "omnimodel-operator"

# Prefix for kopf's progress/diff-base annotations: keeps `status` entirely ours.
KOPF_ANNOTATION_PREFIX: Final = "kopf.omnimodel.io"

# Labels (app.kubernetes.io/*) on every child; selectors use only INSTANCE + COMPONENT + STAGE.
LABEL_NAME: Final = "app.kubernetes.io/name"
LABEL_INSTANCE: Final = "app.kubernetes.io/instance"
LABEL_COMPONENT: Final = "app.kubernetes.io/component"
LABEL_MANAGED_BY: Final = "app.kubernetes.io/managed-by"
LABEL_PART_OF: Final = "app.kubernetes.io/part-of"
LABEL_STAGE: Final = "omnimodel.io/stage"
APP_NAME: Final = "omnimodel"
MANAGED_BY: Final = "omnimodel-operator"

COMPONENT_STAGE: Final = "stage"
COMPONENT_GATEWAY: Final = "gateway"
COMPONENT_PIPELINE: Final = "pipeline"
# The per-OmniModel ServiceAccount every runtime pod runs as (no API token mounted).
COMPONENT_RUNTIME: Final = "runtime"

# Hash of the rendered pipeline file on the pod template: a changed graph rolls the pods.
ANNOTATION_PIPELINE_HASH: Final = "omnimodel.io/pipeline-hash"

# Hash of the manifest the operator last applied to a child (see builders.with_applied_hash).
ANNOTATION_APPLIED_HASH: Final = "omnimodel.io/applied-hash"

# In-pod paths and ports of the runtime (contract-tested against omnimodel_runtime settings).
PIPELINE_MOUNT_DIR: Final = "/etc/omnimodel"
PIPELINE_FILE_KEY: Final = "pipeline.json"
PIPELINE_PATH: Final = f"{PIPELINE_MOUNT_DIR}/{PIPELINE_FILE_KEY}"
MODEL_CACHE_DIR: Final = "/models"
# pvc://claim/path sources are mounted read-only at PVC_ROOT/claim (the runtime's `pvc_root` default).
PVC_ROOT: Final = "/mnt/pvc"
STAGE_PORT: Final = 8001
GATEWAY_PORT: Final = 8000
HEALTH_PATH: Final = "/health"
RUNTIME_UID: Final = 1000

DEFAULT_RUNTIME_REPOSITORY: Final = "ghcr.io/omnimodel/omnimodel-runtime"
