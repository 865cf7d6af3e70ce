"""Pure builders: a plan in, plain manifest dicts out (:func:`render_omnimodel` for this project's
runtime, :func:`~omnimodel_operator.builders.vllm_omni.render_vllm_omni` for vLLM-Omni's; which one a
spec gets is :mod:`omnimodel_operator.runtimes`' choice).

Only these functions set names, labels, owner references, resources and placement; reconcile applies
whatever they return, in order.
"""

from __future__ import annotations

from collections.abc import Mapping

from omnimodel_operator import constants as C
from omnimodel_operator.builders.common import Manifest, content_hash, service_account
from omnimodel_operator.builders.gateway import gateway_deployment, gateway_service
from omnimodel_operator.builders.pipeline import pipeline_configmap
from omnimodel_operator.builders.stage import (
    stage_deployment,
    stage_hpa,
    stage_network_policy,
    stage_pdb,
    stage_service,
)
from omnimodel_operator.builders.weights import fetch_job, weights_claim
from omnimodel_operator.resolve import Plan
from omnimodel_operator.settings import OperatorSettings


def render_omnimodel(
    plan: Plan, settings: OperatorSettings, stage_bytes: Mapping[str, int] | None = None
) -> list[Manifest]:
    """Every child of one OmniModel on this project's runtime, in apply order (config before the pods
    that mount it). ``stage_bytes``: each stage's weights, once the fetch has told (sizes CPU stages)."""
    out: list[Manifest] = [pipeline_configmap(plan), service_account(plan)]
    # The weights: a claim to keep them in (when the operator creates it) and the one fetch into it.
    out.extend(m for m in (weights_claim(plan), fetch_job(plan, settings)) if m is not None)
    for sp in plan.stages:
        out.append(stage_service(plan, sp))
        out.append(stage_deployment(plan, sp, settings, (stage_bytes or {}).get(sp.stage.name)))
        for optional in (stage_hpa(plan, sp), stage_pdb(plan, sp)):
            if optional is not None:
                out.append(optional)
        if settings.network_policy:
            out.append(stage_network_policy(plan, sp, settings))
    out.append(gateway_service(plan))
    out.append(gateway_deployment(plan, settings))
    return out


def with_applied_hash(manifest: Manifest) -> Manifest:
    """Stamp the manifest with a hash of itself. Reconcile skips a child whose live copy carries the
    same hash and still holds every field we set: a no-op reconcile then makes no API writes, while a
    field someone else changed (or one we stopped setting) still gets applied."""
    annotations = {
        **manifest["metadata"].get("annotations", {}),
        C.ANNOTATION_APPLIED_HASH: content_hash(manifest),
    }
    return {**manifest, "metadata": {**manifest["metadata"], "annotations": annotations}}


__all__ = ["Manifest", "render_omnimodel", "with_applied_hash"]
