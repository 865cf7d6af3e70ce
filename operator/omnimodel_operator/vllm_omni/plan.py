"""Resolve an OmniModel with ``runtime.kind: vllm-omni`` into a plan the builders render.

Pure, like :mod:`omnimodel_operator.resolve`: the stage graph comes from the committed catalogue (never
from vLLM-Omni itself), the user's stage entries add placement, replicas and engine arguments, and every
way the combination cannot work is an :class:`~omnimodel_operator.spec.InvalidSpec` naming the field.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Final

from omnimodel_operator import constants as C
from omnimodel_operator import naming
from omnimodel_operator.api.v1alpha1 import SINGLE_STAGE, OmniModelSpec, StageSpec
from omnimodel_operator.settings import OperatorSettings
from omnimodel_operator.spec import InvalidSpec, accelerator_request
from omnimodel_operator.vllm_omni.catalogue import CatalogueEdge, CatalogueStage, DeployConfigEntry, load_catalogue
from omnimodel_runtime.pipeline import (
    AcceleratorRequest,
    EngineName,
    ModelSource,
    Pipeline,
    Stage,
    StageKind,
    Vendor,
)

# Ports of the head pod: the OpenAI API, and the master replicas register with (vLLM-Omni then opens
# ephemeral ports on the head's address for each replica slot, so replicas need the pod IP, not a VIP).
API_PORT: Final = 8000
MASTER_PORT: Final = 25000
# The network connector rendered for edges whose bundled connector is same-host only (shared memory):
# vLLM-Omni's MooncakeStoreConnector over TCP, with a mooncake_master pod per OmniModel.
MOONCAKE_RPC_PORT: Final = 50051
MOONCAKE_METADATA_PORT: Final = 8080
NETWORK_CONNECTOR: Final = "omnimodel_network"
DEPLOY_FILE: Final = "deploy.yaml"
OVERLAY_FILE: Final = "overlay.yaml"
# engineArgs keys that are the operator's to set: a pod's devices are its own (the YAML's host-local
# indices would name devices the pod does not have), and replica counts are Deployments.
_OPERATOR_FIELDS: Final = ("devices", "num_replicas")
# The one stage of the pipeline the weights fetch reads (VllmPlan.pipeline), which every pod waits for.
FETCH_STAGE: Final = "model"


@dataclass(frozen=True)
class VllmStagePlan:
    stage: CatalogueStage
    spec: StageSpec | None
    accelerator: AcceleratorRequest
    # Pods of this stage (for the head's stage: the head plus its extra replicas); None when autoscaled.
    replicas: int | None
    image: str
    # The stage's entry in the rendered deploy file (the bundled one with the user's engineArgs merged).
    deploy: dict[str, Any]

    @property
    def name(self) -> str:
        return self.stage.name


@dataclass(frozen=True)
class VllmPlan:
    name: str
    namespace: str
    spec: OmniModelSpec
    config: DeployConfigEntry
    stages: tuple[VllmStagePlan, ...]
    # What `vllm serve` is given as the model: a hub id, or a path inside the pod.
    model: str
    served_name: str
    # The deploy file the pods mount (YAML text is rendered by the builder); None without a deploy config,
    # when each stage's settings go on the command line as --stage-overrides instead.
    deploy: dict[str, Any] | None
    # Edges whose bundled connector cannot cross pods, now carried by the network connector.
    network_edges: tuple[CatalogueEdge, ...]
    uid: str | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{naming.gateway_name(self.name)}.{self.namespace}.svc:{self.spec.gateway.port}"

    @property
    def head(self) -> VllmStagePlan:
        head_id = self.config.head_stage.id
        return next(s for s in self.stages if s.stage.id == head_id)

    # The view status needs (shared with the omnimodel runtime's Plan) ----------------------------
    @property
    def stage_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.stages)

    def accelerator_of(self, stage: str) -> AcceleratorRequest:
        return next(s.accelerator for s in self.stages if s.name == stage)

    def service_of(self, stage: str) -> str:
        # Stage pods serve nothing of their own: the head's API Service is the one endpoint.
        return self.endpoint if stage == self.head.name else ""

    @property
    def pipeline(self) -> Pipeline:
        """What the weights fetch (builders/weights.py) reads: the model, and one stage, ``model``, that
        needs every file of the repository. Each vLLM-Omni stage loads the model by its hub id from the
        whole snapshot (its weight loader walks every checkpoint file), so there is no per-stage subset."""
        model = self.spec.model
        kind = StageKind.DIFFUSION if self.head.stage.type == "diffusion" else StageKind.AR
        stage = Stage(name=FETCH_STAGE, kind=kind, engine=EngineName.VLLM, task="vllm-omni")
        return Pipeline(
            name=self.name,
            model=ModelSource(source=model.source, revision=model.revision),
            stages=(stage,),
            modalities=(),
            routes=(),
        )

    def wakes(self, stage: str) -> bool:
        return False  # vLLM-Omni's head holds nothing for a stage at zero (the spec refuses minReplicas 0)

    @property
    def modalities(self) -> tuple[str, ...]:
        return tuple(self.config.final_outputs)

    def stages_for(self, modality: str) -> list[str]:
        """Stages a request for ``modality`` passes through: each final stage of it and its ancestors."""
        by_id = {s.id: s for s in self.config.stages}
        wanted = [s.id for s in self.config.stages if s.final_output and s.final_output_type == modality]
        seen: set[int] = set()
        while wanted:
            sid = wanted.pop()
            if sid not in seen:
                seen.add(sid)
                wanted.extend(by_id[sid].inputs)
        return [s.name for s in self.config.stages if s.id in seen]


def model_argument(source: str) -> str:
    """``vllm serve``'s model argument for a model source: hub ids as they are, paths where mounted."""
    scheme, _, rest = source.partition("://")
    if scheme == "hf":
        return rest
    if scheme == "pvc":
        return f"{C.PVC_ROOT}/{rest}"
    if scheme == "file":
        return rest if rest.startswith("/") else f"/{rest}"
    raise InvalidSpec(
        "spec.model.source",
        "tiny:// models are built by the omnimodel runtime; for runtime.kind vllm-omni give the model as "
        "hf://, pvc:// or file:// (a tiny model made with `omnimodel make-tiny` works as file://)",
    )


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _devices(count: int) -> str:
    # Every pod sees its own devices from index 0 (the device plugin hands it exactly `count`).
    return ",".join(str(i) for i in range(max(count, 1)))


def _stage_plan(entry: DeployConfigEntry, stage: CatalogueStage, user: StageSpec | None, image: str) -> VllmStagePlan:
    path = f"spec.stages[{stage.name}]"
    args = dict((user.engine_args if user else None) or {})
    taken = [k for k in _OPERATOR_FIELDS if k in args]
    if taken:
        raise InvalidSpec(
            f"{path}.engineArgs.{taken[0]}",
            "is set by the operator: a pod's devices come from its accelerator, replicas from spec.stages[].replicas",
        )
    try:
        tp = int(args.get("tensor_parallel_size", stage.tensor_parallel_size))
    except (TypeError, ValueError):
        raise InvalidSpec(
            f"{path}.engineArgs.tensor_parallel_size", f"must be a whole number, not {args['tensor_parallel_size']!r}"
        ) from None
    per_replica = stage.devices_per_replica * tp // max(stage.tensor_parallel_size, 1)
    if user is not None and user.accelerator is not None:
        try:
            acc = accelerator_request(user.accelerator)
        except InvalidSpec as err:
            raise InvalidSpec(f"{path}.accelerator", err.message) from None
        if acc.vendor is not Vendor.CPU and acc.count != per_replica:
            raise InvalidSpec(
                f"{path}.accelerator.count",
                f"stage {stage.name} needs {per_replica} device(s) per replica (tensor_parallel_size {tp}), "
                f"not {acc.count}",
            )
    else:
        acc = AcceleratorRequest(vendor=Vendor.NVIDIA, count=per_replica)
    is_head = stage.id == entry.head_stage.id
    if user is not None and user.autoscaling is not None:
        replicas = None
    else:
        replicas = user.replicas if user is not None and user.replicas is not None else 1
    if is_head and replicas == 0:
        raise InvalidSpec(
            f"{path}.replicas",
            "the head pod always runs one replica of the entry stage (vLLM-Omni's API server lives there): at least 1",
        )
    if is_head and user is not None and user.autoscaling is not None:
        raise InvalidSpec(
            f"{path}.autoscaling",
            "the entry stage runs in the head pod, which is a single pod; set replicas instead",
        )
    base: dict[str, Any] = next((s for s in entry.deploy.get("stages") or [] if s.get("stage_id") == stage.id), {})
    deploy = _merge(dict(base), args) | {
        "stage_id": stage.id,
        "devices": _devices(acc.count),
        # The head waits for this many replicas of the stage at start-up; more attach as they come.
        "num_replicas": 1,
    }
    return VllmStagePlan(stage=stage, spec=user, accelerator=acc, replicas=replicas, image=image, deploy=deploy)


def _network_connector(name: str, namespace: str) -> dict[str, Any]:
    master = f"{naming.dns_label(name, 'mooncake')}.{namespace}.svc"
    return {
        "name": "MooncakeStoreConnector",
        "extra": {
            # The address this pod's Mooncake client advertises to its peers: its own pod IP, read by
            # vLLM-Omni's YAML loader (OmegaConf) from the environment at start-up.
            "host": "${oc.env:POD_IP}",
            "metadata_server": f"http://{master}:{MOONCAKE_METADATA_PORT}/metadata",
            "master": f"{master}:{MOONCAKE_RPC_PORT}",
            "proto": "tcp",
            "segment": 64 << 20,
            "localbuf": 16 << 20,
        },
    }


def single_stage_entry() -> DeployConfigEntry:
    """What vLLM-Omni serves for a diffusers model given no deploy config: one diffusion stage."""
    stage = CatalogueStage(
        id=0, name=SINGLE_STAGE, model_stage=None, type="diffusion", inputs=[], devices="0",
        devices_per_replica=1, tensor_parallel_size=1, num_replicas=1, final_output=True,
        final_output_type="image", async_chunk=False, kv_transfer=None,
    )  # fmt: skip
    return DeployConfigEntry(
        name="", file="", pipeline="diffusers", pipeline_source="name-match", model_arch=None,
        diffusers_class_name=None, async_chunk=False, session_mode="turn", platform_overlays=[],
        stages=[stage], edges=[], final_outputs=["image"], routes=["images.edits", "images.generations"],
        same_host_only=False, deploy={},
    )  # fmt: skip


def resolve_vllm_omni(
    name: str, namespace: str, spec: OmniModelSpec, settings: OperatorSettings, uid: str | None = None
) -> VllmPlan:
    bundled = spec.runtime.deploy_config
    entry = load_catalogue().get(bundled) if bundled else single_stage_entry()
    users = {s.name: s for s in spec.stages or []}
    stages = tuple(
        _stage_plan(
            entry,
            stage,
            users.get(stage.name),
            spec.runtime.image or settings.vllm_omni_image(_vendor(users.get(stage.name))),
        )
        for stage in entry.stages
    )
    network = tuple(e for e in entry.edges if e.same_host_only)
    deploy = {k: copy.deepcopy(v) for k, v in entry.deploy.items() if k not in ("stages", "connectors")}
    for overlay in (deploy.get("platforms") or {}).values():
        # Platform overlays also name host-local devices (npu: "stage 2 lives on its own card"); a pod's
        # devices are its own, whatever platform it lands on.
        for stage_overlay in overlay.get("stages") or []:
            for key in _OPERATOR_FIELDS:
                stage_overlay.pop(key, None)
    connectors: dict[str, Any] = copy.deepcopy(entry.deploy.get("connectors") or {})
    same_host = {e.connector for e in network}
    network_spec = _network_connector(name, namespace)
    for key, connector in list(connectors.items()):
        if connector.get("name") in same_host:
            # Same name, so every stage that refers to it keeps doing so; its model-specific settings
            # (codec chunk sizes, waits) stay, the transport becomes one that crosses pods.
            connectors[key] = {
                "name": network_spec["name"],
                "extra": {**dict(connector.get("extra") or {}), **network_spec["extra"]},
            }
    defaulted = [e for e in network if e.connector_source == "default"]
    if defaulted:
        connectors[NETWORK_CONNECTOR] = network_spec
    if connectors:
        deploy["connectors"] = connectors
    rendered = []
    for sp in stages:
        stage_deploy = dict(sp.deploy)
        into = [e for e in defaulted if e.to == sp.stage.id]
        if into:
            stage_deploy["input_connectors"] = {
                **dict(stage_deploy.get("input_connectors") or {}),
                **{f"from_stage_{e.from_}": NETWORK_CONNECTOR for e in into},
            }
        rendered.append(stage_deploy)
    deploy["stages"] = rendered
    model = model_argument(spec.model.source)

    return VllmPlan(
        name=name,
        namespace=namespace,
        spec=spec,
        config=entry,
        stages=stages,
        model=model,
        served_name=spec.model.served_name or model,
        # No deploy config: vLLM-Omni builds the stage from the model; settings travel as --stage-overrides.
        deploy=deploy if bundled else None,
        network_edges=network,
        uid=uid,
    )


def _vendor(user: StageSpec | None) -> Vendor:
    return user.accelerator.vendor if user is not None and user.accelerator is not None else Vendor.NVIDIA
