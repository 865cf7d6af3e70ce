"""The pipeline ConfigMap: the resolved stage graph every runtime process reads."""

from __future__ import annotations

from omnimodel_operator import constants as C
from omnimodel_operator import naming
from omnimodel_operator.builders.common import Manifest, metadata
from omnimodel_operator.resolve import Plan


def pipeline_configmap(plan: Plan) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(
            plan,
            naming.pipeline_configmap_name(plan.name),
            naming.common_labels(plan.name, C.COMPONENT_PIPELINE),
        ),
        "data": {C.PIPELINE_FILE_KEY: plan.pipeline.to_json()},
    }
