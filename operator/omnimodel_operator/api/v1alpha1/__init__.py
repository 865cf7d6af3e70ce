"""``omnimodel.io/v1alpha1`` OmniModel: spec and status as pydantic models.

These models are the single source of truth: the CRD in ``crds/`` is generated from them
(:mod:`omnimodel_operator.crdgen`), and the operator parses every object through them once per reconcile.
CEL rules live next to the fields they guard (``cel(...)``) so that the API server and the operator
enforce the same invariants.

The models live in one module per part of the object (:mod:`.model`, :mod:`.runtime`, :mod:`.stage`,
:mod:`.status`, and :mod:`.omnimodel` for the spec's cross-field rules and the object itself); callers
import them from here.
"""

from omnimodel_operator.api.v1alpha1.base import (
    ALL_TASKS,
    DEFAULT_AUTOSCALING_TARGETS,
    MAX_INPUTS,
    MAX_STAGES,
    RESERVED_STAGE_NAMES,
    SINGLE_STAGE,
    TINY_MODELS,
    VLLM_OMNI_CONFIGS,
    VLLM_OMNI_VERSION,
    DnsLabel,
    FreeForm,
    KubeModel,
    Quantity,
    cel,
)
from omnimodel_operator.api.v1alpha1.model import ModelCache, ModelSpec, SecretKey
from omnimodel_operator.api.v1alpha1.omnimodel import OmniModel, OmniModelSpec
from omnimodel_operator.api.v1alpha1.runtime import (
    DeployConfigRef,
    EnvVar,
    GatewaySpec,
    Resources,
    RuntimeSpec,
    Toleration,
)
from omnimodel_operator.api.v1alpha1.stage import Accelerator, Autoscaling, Disruption, ScalingRatio, StageSpec
from omnimodel_operator.api.v1alpha1.status import (
    AutoscalerStatus,
    ComponentStatus,
    Condition,
    OmniModelStatus,
    StageStatus,
    StatusModel,
    WeightsStatus,
)

__all__ = [
    "ALL_TASKS",
    "DEFAULT_AUTOSCALING_TARGETS",
    "MAX_INPUTS",
    "MAX_STAGES",
    "RESERVED_STAGE_NAMES",
    "SINGLE_STAGE",
    "TINY_MODELS",
    "VLLM_OMNI_CONFIGS",
    "VLLM_OMNI_VERSION",
    "Accelerator",
    "AutoscalerStatus",
    "Autoscaling",
    "ComponentStatus",
    "Condition",
    "DeployConfigRef",
    "Disruption",
    "DnsLabel",
    "EnvVar",
    "FreeForm",
    "GatewaySpec",
    "KubeModel",
    "ModelCache",
    "ModelSpec",
    "OmniModel",
    "OmniModelSpec",
    "OmniModelStatus",
    "Quantity",
    "Resources",
    "RuntimeSpec",
    "ScalingRatio",
    "SecretKey",
    "StageSpec",
    "StageStatus",
    "StatusModel",
    "Toleration",
    "WeightsStatus",
    "cel",
]
