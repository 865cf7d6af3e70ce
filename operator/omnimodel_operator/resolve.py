"""Resolve an OmniModel into a plan: the runtime's pipeline file plus per-stage workload settings.

Pure: no I/O. Everything the builders render comes from a :class:`Plan`, and every way a spec can be
wrong surfaces here as :class:`InvalidSpec` naming the field, before anything is applied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from omnimodel_operator import constants as C
from omnimodel_operator import naming
from omnimodel_operator.api.v1alpha1 import TINY_MODELS, OmniModelSpec, StageSpec
from omnimodel_operator.settings import OperatorSettings
from omnimodel_operator.spec import InvalidSpec, accelerator_request
from omnimodel_runtime.pipeline import (
    ENGINE_TASKS,
    AcceleratorRequest,
    Modality,
    ModelSource,
    Pipeline,
    PipelineError,
    Stage,
    Vendor,
    default_routes,
    get_preset,
    validation_problems,
)


@dataclass(frozen=True)
class StagePlan:
    stage: Stage
    spec: StageSpec | None
    # None when the stage autoscales: the HPA owns `replicas`, the operator must not set it.
    replicas: int | None
    image: str

    @property
    def name(self) -> str:
        return self.stage.name


@dataclass(frozen=True)
class Plan:
    name: str
    namespace: str
    spec: OmniModelSpec
    pipeline: Pipeline
    stages: tuple[StagePlan, ...]
    gateway_image: str
    # The OmniModel's uid, for owner references; None when rendering a file that was never applied.
    uid: str | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{naming.gateway_name(self.name)}.{self.namespace}.svc:{self.spec.gateway.port}"

    # The view status needs (see status.StatusView) -------------------------------------------
    @property
    def modalities(self) -> tuple[str, ...]:
        return tuple(m.value for m in self.pipeline.modalities)

    def stages_for(self, modality: str) -> list[str]:
        return [s.name for s in self.pipeline.stages_for([Modality(modality)])]

    def accelerator_of(self, stage: str) -> AcceleratorRequest:
        return self.pipeline.stage(stage).accelerator

    def service_of(self, stage: str) -> str:
        return _endpoint(self.name, self.namespace, stage)

    def wake_timeouts(self) -> dict[str, int]:
        """Stages that may sit at zero replicas (minReplicas 0 on the operator's autoscaler), with how
        long the gateway holds a request for each while it wakes."""
        return {
            sp.name: sp.spec.autoscaling.wake_timeout_seconds
            for sp in self.stages
            if sp.spec is not None
            and sp.spec.autoscaling is not None
            and sp.spec.autoscaling.min_replicas == 0
            and sp.spec.autoscaling.provider == "operator"
        }

    def wakes(self, stage: str) -> bool:
        return stage in self.wake_timeouts()


def _overrides(stage: StageSpec, base: Stage | None) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if stage.engine is not None:
        fields["engine"] = stage.engine
    if stage.accelerator is not None:
        try:
            fields["accelerator"] = accelerator_request(stage.accelerator)
        except InvalidSpec as err:
            raise InvalidSpec(f"spec.stages[{stage.name}].accelerator", err.message) from None
    if stage.engine_args is not None:
        fields["engine_args"] = {**(base.engine_args if base else {}), **stage.engine_args}
    return fields


def _endpoint(cr: str, namespace: str, stage: str) -> str:
    return f"http://{naming.stage_name(cr, stage)}.{namespace}.svc:{C.STAGE_PORT}"


def _spec_path(path: str) -> str:
    return path if path.startswith("spec") else f"spec.{path}"


def build_pipeline(name: str, namespace: str, spec: OmniModelSpec) -> Pipeline:
    """The pipeline file content: preset expanded, overrides applied, endpoints filled in."""
    model = ModelSource(source=spec.model.source, revision=spec.model.revision, served_name=spec.model.served_name)
    user_stages = {s.name: s for s in spec.stages or []}
    try:
        if spec.preset:
            preset = get_preset(spec.preset)
            base = {s.name: s for s in preset.stages}
            overrides = {n: _overrides(s, base.get(n)) for n, s in user_stages.items()}
            for stage_name in preset.stage_names:
                overrides.setdefault(stage_name, {})
                overrides[stage_name]["endpoints"] = (_endpoint(name, namespace, stage_name),)
            return preset.pipeline(model, name=name, overrides=overrides)
        stages = []
        for s in spec.stages or []:
            missing = [f for f in ("engine", "kind", "task") if getattr(s, f) is None]
            if missing:
                raise InvalidSpec(
                    f"spec.stages[{s.name}].{missing[0]}",
                    f"without a preset every stage needs {', '.join(missing)}",
                )
            stages.append(
                Stage(
                    name=s.name,
                    kind=s.kind,
                    engine=s.engine,
                    task=s.task,
                    inputs=tuple(s.inputs or ()),
                    outputs=tuple(s.outputs or ()),
                    endpoints=(_endpoint(name, namespace, s.name),),
                    **{k: v for k, v in _overrides(s, None).items() if k != "engine"},
                )
            )
        modalities = tuple(m for m in Modality if any(m in s.outputs for s in stages))
        if not modalities:
            raise InvalidSpec("spec.stages", "no stage lists outputs, so the graph returns nothing")
        return Pipeline(
            name=name,
            model=model,
            stages=tuple(stages),
            modalities=modalities,
            routes=default_routes(modalities),
        )
    except PipelineError as err:
        path, message = err.problems[0]
        raise InvalidSpec(_spec_path(path), message) from None
    except ValidationError as err:
        path, message = validation_problems(err)[0]
        raise InvalidSpec(_spec_path(path), message) from None


def check_engines(pipeline: Pipeline) -> None:
    """Every stage's engine runs its task: a preset stage given another engine (``engine: diffusers`` on
    preset text's llm) would otherwise roll out and fail in the pod. The CRD's CEL rules say the same."""
    for stage in pipeline.stages:
        if stage.task not in ENGINE_TASKS[stage.engine]:
            able = [e.value for e, tasks in ENGINE_TASKS.items() if stage.task in tasks]
            raise InvalidSpec(
                f"spec.stages[{stage.name}].engine",
                f"engine {stage.engine.value} does not run task {stage.task} of stage {stage.name}"
                + (f" (preset {pipeline.preset})" if pipeline.preset else "")
                + f"; engines that do: {', '.join(able)}",
            )


def check_tiny_model(spec: OmniModelSpec) -> None:
    """A ``tiny://`` source names a tiny model the runtime can build, and with a preset the one built for
    that preset's graph (another preset's weights would not load). The CRD's CEL rules say the same."""
    scheme, _, name = spec.model.source.partition("://")
    if scheme != "tiny":
        return
    if name not in TINY_MODELS:
        known = ", ".join(f"tiny://{m}" for m in TINY_MODELS)
        raise InvalidSpec("spec.model.source", f"no tiny model {name!r}: tiny:// takes {known}")
    if spec.preset is not None and TINY_MODELS[name] != spec.preset:
        raise InvalidSpec(
            "spec.model.source",
            f"tiny://{name} is built for preset {TINY_MODELS[name]}; preset {spec.preset} needs tiny://{spec.preset}",
        )


def _no_image(vendor: Vendor) -> str:
    # Said here rather than left to the kubelet: a made-up default tag would only show up later as an
    # ImagePullBackOff on a node, far from the setting that fixes it.
    return (
        f"no runtime image for vendor {vendor.value}: this project publishes none for it; set the "
        f"operator's image for {vendor.value} (Helm value runtime.images.{vendor.value}, or "
        f"OMNIMODEL_RUNTIME_IMAGES) or spec.runtime.image (used by every stage and the gateway)"
    )


def resolve_omnimodel(
    name: str, namespace: str, spec: OmniModelSpec, settings: OperatorSettings, uid: str | None = None
) -> Plan:
    """Spec → plan for this project's runtime (gateway + one process per stage)."""
    pipeline = build_pipeline(name, namespace, spec)
    check_engines(pipeline)
    check_tiny_model(spec)
    user_stages = {s.name: s for s in spec.stages or []}
    plans = []
    for stage in pipeline.stages:
        user = user_stages.get(stage.name)
        if user is not None and user.autoscaling is not None:
            replicas = None
        else:
            replicas = user.replicas if user is not None and user.replicas is not None else 1
        image = spec.runtime.image or settings.runtime_image(stage.accelerator.vendor)
        if image is None:
            raise InvalidSpec(f"spec.stages[{stage.name}].accelerator.vendor", _no_image(stage.accelerator.vendor))
        plans.append(StagePlan(stage=stage, spec=user, replicas=replicas, image=image))
    gateway_image = spec.runtime.image or settings.cpu_runtime_image
    return Plan(
        name=name,
        namespace=namespace,
        spec=spec,
        pipeline=pipeline,
        stages=tuple(plans),
        gateway_image=gateway_image,
        uid=uid,
    )
