"""Typed view of ``catalogue.json``: vLLM-Omni's bundled deploy configs as the operator renders them.

The file is generated in the vLLM-Omni environment from vLLM-Omni's own code (``load_deploy_config`` and
``VllmOmniConfig.from_pipeline_config``, the path ``vllm serve --omni --deploy-config`` takes) by
``e2e/vllm-omni/gen_catalogue.py``; nothing here imports vLLM or vLLM-Omni, so the operator image stays
slim. Values are the configs' base values: per-platform overlays (``platforms:`` in a YAML) are listed in
:attr:`DeployConfigEntry.platform_overlays` but not applied.
"""

from __future__ import annotations

import functools
from importlib import resources
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

__all__ = [
    "CATALOGUE_FILE",
    "Catalogue",
    "CatalogueEdge",
    "CatalogueStage",
    "DeployConfigEntry",
    "KvTransfer",
    "StageType",
    "load_catalogue",
]

CATALOGUE_FILE = "catalogue.json"

#: vLLM-Omni's stage execution types: autoregressive LLM (thinker, talker), non-autoregressive generation
#: on the LLM engine (code2wav-style vocoders), and diffusion (DiT pipelines).
StageType = Literal["ar", "generation", "diffusion"]


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


class KvTransfer(_Model):
    """vLLM KV-cache transfer a stage takes part in: a data path of its own beside the stage connector."""

    connector: str = Field(description="vLLM KV connector (kv_transfer_config.kv_connector), e.g. MooncakeConnector.")
    role: str | None = Field(description="kv_role: kv_producer, kv_consumer or kv_both.")


class CatalogueStage(_Model):
    """One stage of a deploy config, after the pipeline topology and the YAML are merged."""

    id: int = Field(ge=0, description="vLLM-Omni stage id (--stage-id, the keys of --stage-overrides).")
    name: str = Field(
        description="DNS-label name for spec.stages[].name and child objects: the pipeline's model_stage "
        "lower-cased with '_' -> '-' (thinker, talker, code2wav, dit), or 'stage-<id>' when the stage has "
        "none, it is not a DNS label, or two stages share it."
    )
    model_stage: str | None = Field(description="vLLM-Omni's own stage name (StagePipelineConfig.model_stage).")
    type: StageType = Field(description="Execution type: ar (LLM_AR), generation (LLM_GENERATION), diffusion.")
    inputs: list[int] = Field(description="Upstream stage ids (input_sources); empty for an entry stage.")
    devices: str | None = Field(
        description="The YAML's host-local device list for the whole stage (all its replicas), e.g. '0,1'. "
        "A pod renders its own slice (see devices_per_replica)."
    )
    devices_per_replica: int = Field(
        ge=1, description="Accelerators one replica of the stage uses (vLLM-Omni's get_stage_devices_per_replica)."
    )
    tensor_parallel_size: int = Field(ge=1, description="Tensor-parallel size of the stage's engine.")
    num_replicas: int = Field(ge=1, description="Default replica count (the YAML's num_replicas).")
    final_output: bool = Field(description="Whether the stage's output goes back to the client.")
    final_output_type: str | None = Field(
        description="Modality of that output when final: text, audio, image, video, action(s); else null."
    )
    async_chunk: bool = Field(description="Whether the stage streams chunks to/from its neighbours (async_chunk).")
    kv_transfer: KvTransfer | None = Field(description="vLLM KV transfer the stage takes part in, if any.")


class CatalogueEdge(_Model):
    """Data path from one stage to the next, with the connector vLLM-Omni configures on it."""

    from_: int = Field(alias="from", description="Producing stage id.")
    to: int = Field(description="Consuming stage id.")
    connector: str = Field(description="OmniConnector name, e.g. SharedMemoryConnector, MooncakeStoreConnector.")
    connector_source: Literal["deploy", "default"] = Field(
        description="'deploy': named in the YAML (connectors/input_connectors/output_connectors); 'default': the "
        "stage connector vLLM-Omni uses when the YAML names none (SharedMemoryConnector in 0.30.0)."
    )
    same_host_only: bool = Field(
        description="True when the connector only works between processes of one host, so the two stages "
        "cannot run in different pods (shared memory; Mori over XGMI)."
    )
    transport: str = Field(description="What the connector moves data over, in words.")
    async_chunk: bool = Field(description="Whether the consuming stage receives streamed chunks on this edge.")


class DeployConfigEntry(_Model):
    """One bundled deploy config (``vllm_omni/deploy/<name>.yaml``)."""

    name: str = Field(description="File stem: what spec.runtime.deployConfig names.")
    file: str = Field(description="Path inside the vllm_omni package.")
    pipeline: str = Field(description="vLLM-Omni pipeline registry key the config is for.")
    pipeline_source: Literal[
        "deploy-pipeline-key", "default-deploy-config", "base-config", "checkpoint-model-type", "name-match"
    ] = Field(
        description="How the generator chose the pipeline: the YAML's pipeline: key; the pipeline whose "
        "default deploy config this is; its base_config's pipeline; the model type its header names; or "
        "vLLM-Omni's own basename match on the file name."
    )
    model_arch: str | None = Field(
        description="Model architecture class of the pipeline, e.g. Qwen2_5OmniForConditionalGeneration."
    )
    diffusers_class_name: str | None = Field(description="Diffusers pipeline class, for diffusion pipelines.")
    async_chunk: bool = Field(description="Pipeline-wide streaming between stages (false for single-stage configs).")
    session_mode: str = Field(description="turn (request/response) or duplex (realtime sessions).")
    platform_overlays: list[str] = Field(description="Platforms with overrides in the YAML (not applied here).")
    stages: list[CatalogueStage] = Field(min_length=1, description="Stages, by id.")
    edges: list[CatalogueEdge] = Field(description="One per (input, stage) pair.")
    final_outputs: list[str] = Field(description="Modalities the pipeline returns (sorted).")
    routes: list[str] = Field(
        description="OpenAI route families that return those outputs, minus the pipeline's endpoint "
        "restrictions: chat.completions, completions, responses, audio.speech, images.generations, "
        "images.edits, videos. vLLM-Omni registers every route and answers the others with an error."
    )
    same_host_only: bool = Field(description="Some edge uses a same-host-only connector.")
    deploy: dict[str, Any] = Field(
        description="The deploy YAML as vLLM-Omni's resolve_deploy_yaml reads it (base_config chain merged, "
        "platform overlays still under platforms:): the base of the deploy file the operator renders."
    )

    def stage(self, key: int | str) -> CatalogueStage:
        """A stage by id or by name; KeyError naming the known ones otherwise."""
        for stage in self.stages:
            if key in (stage.id, stage.name):
                return stage
        raise KeyError(f"deploy config {self.name!r} has no stage {key!r}; stages: {[s.name for s in self.stages]}")

    @property
    def head_stage(self) -> CatalogueStage:
        """The entry stage (no inputs, lowest id): the one a head pod runs beside the API server."""
        return min((s for s in self.stages if not s.inputs), key=lambda s: s.id)


class Catalogue(_Model):
    """Every bundled deploy config of one vLLM-Omni release."""

    schema_version: int = Field(description="Version of this file's layout.")
    vllm_omni_version: str = Field(description="vLLM-Omni release the file was generated from.")
    vllm_version: str = Field(description="vLLM release installed beside it.")
    configs: list[DeployConfigEntry] = Field(description="Sorted by name.")

    def get(self, name: str) -> DeployConfigEntry:
        """A config by name (file stem; a trailing .yaml is accepted); KeyError otherwise."""
        stem = name.removesuffix(".yaml")
        for entry in self.configs:
            if entry.name == stem:
                return entry
        raise KeyError(f"{name!r} is not a bundled vLLM-Omni {self.vllm_omni_version} deploy config")

    def names(self) -> list[str]:
        """Every config name."""
        return [c.name for c in self.configs]


@functools.cache
def load_catalogue() -> Catalogue:
    """The committed catalogue (parsed once per process)."""
    text = resources.files(__package__).joinpath(CATALOGUE_FILE).read_text()
    return Catalogue.model_validate_json(text)
