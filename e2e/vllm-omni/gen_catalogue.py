"""Write the operator's catalogue of vLLM-Omni's bundled deploy configs, from vLLM-Omni's own config code.

Run in the vLLM-Omni environment (``make vllm-omni-catalogue``)::

    <env>/bin/python e2e/vllm-omni/gen_catalogue.py OUT.json

For every ``vllm_omni/deploy/*.yaml`` it picks the pipeline the YAML is for and builds the typed stage
configs exactly as ``vllm serve --omni --deploy-config`` does (``load_deploy_config`` +
``VllmOmniConfig.from_pipeline_config``), then writes what the operator needs to render one Deployment
per stage: stage ids, names, types, inputs, devices, TP, replicas, final outputs, the connector on each
edge and whether it works across hosts, and the OpenAI routes the pipeline answers. The output is
deterministic (sorted, no timestamps) so a drift check can diff it.

No checkpoint is involved: the pipeline topology comes from vLLM-Omni's registry, not from a model's
``config.json``. The pipeline of a YAML is, in this order: its own ``pipeline:`` key; the pipeline whose
``default_deploy_config_name`` is this file; for an overlay (``base_config:``), its base's pipeline; for
the few YAMLs only a checkpoint's model_type places, the model class their header names
(``CHECKPOINT_MODEL_TYPES``); else vLLM-Omni's own model-type inference on a model
directory named like the YAML (the basename match it uses for checkpoints without a usable config).
Per-platform overlays (``platforms:``) are not applied: the generator runs with no accelerator, so the
base (CUDA) values are recorded and the overlay platforms are listed.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

# The catalogue must not depend on the machine's platform plugin.
os.environ.pop("OMNIMODEL_VLLM_OMNI_CPU", None)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import vllm
import vllm_omni
import yaml
from vllm_omni.config.config_factory import StageConfigFactory
from vllm_omni.config.endpoint_policy import OmniServingCapability
from vllm_omni.config.omni_config import VllmOmniConfig
from vllm_omni.config.pipeline_registry import OMNI_PIPELINES, resolve_pipeline_config
from vllm_omni.config.stage_config import (
    PipelineConfig,
    StageExecutionType,
    load_deploy_config,
    resolve_deploy_yaml,
)
from vllm_omni.distributed.omni_connectors import load_omni_transfer_config
from vllm_omni.distributed.omni_connectors.factory import OmniConnectorFactory
from vllm_omni.engine import stage_init_utils

SCHEMA_VERSION = 1
DEPLOY_DIR = Path(vllm_omni.__file__).parent / "deploy"

# Whether each connector vLLM-Omni registers can carry an edge between two hosts (two pods). A
# connector missing here fails the run: a new one must be classified before the operator sees it.
CONNECTORS: dict[str, tuple[bool, str]] = {
    # name: (same_host_only, why)
    "SharedMemoryConnector": (True, "POSIX shared memory segments in /dev/shm: one host (one pod) only"),
    "MooncakeStoreConnector": (False, "Mooncake distributed store (TCP/RDMA)"),
    "MooncakeConnector": (False, "alias of MooncakeStoreConnector"),
    "MooncakeTransferEngineConnector": (False, "Mooncake transfer engine (TCP/RDMA)"),
    "NixlConnector": (False, "NIXL (UCX/RDMA)"),
    "MoriTransferEngineConnector": (False, "Mori RDMA IOEngine (xgmi backend: one node only)"),
    "YuanrongConnector": (False, "Yuanrong datasystem (network)"),
    "YuanrongTransferEngineConnector": (False, "Yuanrong transfer engine (network, NPU)"),
}

STAGE_TYPES = {
    StageExecutionType.LLM_AR: "ar",
    StageExecutionType.LLM_GENERATION: "generation",
    StageExecutionType.DIFFUSION: "diffusion",
}

# Final output modality -> the OpenAI route families that return it. vLLM-Omni registers every route on
# every server and answers the ones a pipeline cannot serve with an error; these are the ones that produce
# this pipeline's outputs.
ROUTES_BY_OUTPUT: dict[str, tuple[str, ...]] = {
    "text": ("chat.completions", "completions", "responses"),
    "audio": ("chat.completions", "audio.speech"),
    "image": ("chat.completions", "images.generations", "images.edits"),
    "video": ("videos",),
}
RESTRICTABLE_ROUTES = {
    OmniServingCapability.COMPLETIONS: "completions",
    OmniServingCapability.IMAGE_EDITS: "images.edits",
}

# YAMLs for checkpoints whose model_type alone selects the pipeline (no pipeline:, no default, and a name
# vLLM-Omni's basename match cannot place). Each is what the YAML's own header names as the model class.
CHECKPOINT_MODEL_TYPES: dict[str, str] = {
    "moss_sound_effect": "moss_tts_delay",  # "MOSS-SoundEffect (MossTTSDelayModel, ...)"
    "moss_ttsd": "moss_tts_delay",  # "MOSS-TTSD-v1.0 (MossTTSDelayModel, ...)"
    "moss_voice_generator": "moss_tts_delay",  # "MOSS-VoiceGenerator (MossTTSDelayModel, ...)"
    "moss_tts_80gb": "moss_tts_delay",  # "Single-80GB variant of moss_tts.yaml ... (MossTTSDelayModel, ...)"
}

_DNS_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")

log = logging.getLogger("gen_catalogue")


def all_pipelines() -> dict[str, PipelineConfig]:
    """Every PipelineConfig vLLM-Omni defines, by model_type: registry values and, for resolver entries
    (which need a checkpoint's config to choose), every PipelineConfig in the resolver's module."""
    out: dict[str, PipelineConfig] = {}
    for key, value in OMNI_PIPELINES.items():
        if isinstance(value, PipelineConfig):
            out.setdefault(key, value)
            continue
        module = sys.modules[value.__module__]
        for obj in vars(module).values():
            if isinstance(obj, PipelineConfig):
                out.setdefault(obj.model_type, obj)
    return out


def pick_pipeline(yaml_path: Path, deploy: Any, pipelines: dict[str, PipelineConfig], scratch: Path) -> tuple[str, str]:
    """(pipeline key, how it was chosen) for one deploy YAML."""
    if deploy.pipeline:
        return deploy.pipeline, "deploy-pipeline-key"
    defaults = sorted(k for k, p in pipelines.items() if p.default_deploy_config_name == yaml_path.name)
    if defaults:
        # Aliases (two registry keys, one pipeline) share a default: the pipeline's own model_type wins.
        key = next((k for k in defaults if pipelines[k].model_type == k), defaults[0])
        return key, "default-deploy-config"
    base = (yaml.safe_load(yaml_path.read_text()) or {}).get("base_config")
    if base:
        # An overlay of another bundled YAML serves that YAML's pipeline.
        base_path = yaml_path.parent / base
        key, _ = pick_pipeline(base_path, load_deploy_config(base_path), pipelines, scratch)
        return key, "base-config"
    if yaml_path.stem in CHECKPOINT_MODEL_TYPES:
        return CHECKPOINT_MODEL_TYPES[yaml_path.stem], "checkpoint-model-type"
    model_dir = scratch / yaml_path.stem
    model_dir.mkdir(exist_ok=True)
    inferred = StageConfigFactory._try_infer_model_type(str(model_dir), False)
    if inferred is None:
        raise SystemExit(f"{yaml_path.name}: no pipeline found (no pipeline:, no default, no name match)")
    return inferred, "name-match"


def stage_names(stages: list[tuple[int, str | None]]) -> dict[int, str]:
    """DNS-label stage names: the pipeline's model_stage ("thinker"), else ``stage-N`` (also for duplicates)."""
    raw = {sid: (ms or "").lower().replace("_", "-") for sid, ms in stages}
    counts: dict[str, int] = {}
    for name in raw.values():
        counts[name] = counts.get(name, 0) + 1
    out = {}
    for sid, name in raw.items():
        ok = bool(name) and counts[name] == 1 and _DNS_LABEL.match(name) and not re.fullmatch(r"stage-\d+", name)
        out[sid] = name if ok else f"stage-{sid}"
    return out


def connector_entry(spec: Any, source: str) -> dict[str, Any]:
    name = spec.name if hasattr(spec, "name") else spec["name"]
    extra = (spec.extra if hasattr(spec, "extra") else spec.get("extra")) or {}
    if name not in CONNECTORS:
        raise SystemExit(f"connector {name!r} is not classified in gen_catalogue.CONNECTORS")
    same_host, why = CONNECTORS[name]
    if name == "MoriTransferEngineConnector" and str(extra.get("backend_type", "")).lower() == "xgmi":
        same_host, why = True, "Mori over XGMI (AMD Infinity Fabric): GPUs of one node only"
    return {"connector": name, "connectorSource": source, "sameHostOnly": same_host, "transport": why}


def kv_transfer(connector_config: Any) -> dict[str, Any] | None:
    """vLLM's KV-cache transfer a stage takes part in (a second data path beside the stage connector)."""
    kv = connector_config.kv_transfer_config
    if kv is None:
        return None
    return {"connector": kv.kv_connector, "role": kv.kv_role}


def describe(yaml_path: Path, pipelines: dict[str, PipelineConfig], scratch: Path) -> dict[str, Any]:
    deploy = load_deploy_config(yaml_path)
    key, how = pick_pipeline(yaml_path, deploy, pipelines, scratch)
    pipeline = pipelines.get(key) or resolve_pipeline_config(key, None)
    if pipeline is None:
        raise SystemExit(f"{yaml_path.name}: pipeline {key!r} is not registered")
    cfg = VllmOmniConfig.from_pipeline_config(
        pipeline,
        user_deploy_config=deploy,
        deploy_config_path=str(yaml_path),
        cli_overrides={"model": str(scratch / yaml_path.stem)},
    )
    typed = {s.stage_pipeline_config.stage_id: s for s in cfg.stage_configs}
    names = stage_names([(sid, s.stage_pipeline_config.model_stage) for sid, s in sorted(typed.items())])

    stages = []
    for sid, s in sorted(typed.items()):
        sp, rt = s.stage_pipeline_config, s.runtime_config
        stages.append(
            {
                "id": sid,
                "name": names[sid],
                "modelStage": sp.model_stage,
                "type": STAGE_TYPES[sp.execution_type],
                "inputs": sorted(sp.input_sources),
                "devices": rt.devices,
                "devicesPerReplica": int(stage_init_utils.get_stage_devices_per_replica(s)),
                "tensorParallelSize": int(getattr(s.parallel_config, "tensor_parallel_size", 1) or 1),
                "numReplicas": int(rt.num_replicas),
                "finalOutput": bool(sp.final_output),
                "finalOutputType": sp.final_output_type if sp.final_output else None,
                "asyncChunk": bool(s.connector_config.async_chunk),
                "kvTransfer": kv_transfer(s.connector_config),
            }
        )

    transfer = load_omni_transfer_config(config_dict=resolve_deploy_yaml(yaml_path))
    declared = dict(getattr(transfer, "connectors", {}) or {})
    edges = []
    for stage in stages:
        for src in stage["inputs"]:
            spec = declared.get((str(src), str(stage["id"])))
            if spec is not None:
                entry = connector_entry(spec, "deploy")
            else:
                # No connector in the YAML: the stage's default data-plane connector.
                entry = connector_entry(typed[stage["id"]].connector_config.stage_connector, "default")
            edges.append({"from": src, "to": stage["id"], "asyncChunk": stage["asyncChunk"], **entry})

    outputs = sorted({s["finalOutputType"] for s in stages if s["finalOutput"] and s["finalOutputType"]})
    restricted = {RESTRICTABLE_ROUTES[r.capability] for r in pipeline.endpoint_restrictions}
    routes = sorted({r for o in outputs for r in ROUTES_BY_OUTPUT.get(o, ())} - restricted)
    return {
        "name": yaml_path.stem,
        "file": f"vllm_omni/deploy/{yaml_path.name}",
        "pipeline": key,
        "pipelineSource": how,
        "modelArch": pipeline.model_arch or None,
        "diffusersClassName": pipeline.diffusers_class_name,
        "asyncChunk": bool(deploy.async_chunk) and len(stages) > 1,
        "sessionMode": deploy.session_mode,
        "platformOverlays": sorted((deploy.platforms or {}).keys()),
        "stages": stages,
        "edges": edges,
        "finalOutputs": outputs,
        "routes": routes,
        "sameHostOnly": any(e["sameHostOnly"] for e in edges),
        # The YAML as vLLM-Omni reads it (base_config chain merged): the operator writes it, with its
        # per-pod overrides, into the deploy file it mounts, so a pod never depends on where an image
        # installed the bundled file.
        "deploy": resolve_deploy_yaml(yaml_path),
    }


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if len(argv) != 2:
        print(f"usage: {argv[0]} OUT.json", file=sys.stderr)
        return 2
    missing = set(OmniConnectorFactory.list_registered_connectors()) - set(CONNECTORS)
    if missing:
        raise SystemExit(f"connectors not classified in gen_catalogue.CONNECTORS: {sorted(missing)}")
    pipelines = all_pipelines()
    yamls = sorted(DEPLOY_DIR.glob("*.yaml"))
    with tempfile.TemporaryDirectory() as tmp:
        configs = [describe(y, pipelines, Path(tmp)) for y in yamls]
    catalogue = {
        "schemaVersion": SCHEMA_VERSION,
        "vllmOmniVersion": vllm_omni.__version__,
        "vllmVersion": vllm.__version__,
        "configs": configs,
    }
    Path(argv[1]).write_text(json.dumps(catalogue, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(configs)} configs to {argv[1]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
