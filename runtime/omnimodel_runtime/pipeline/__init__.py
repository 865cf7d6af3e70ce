"""The pipeline contract: the stage graph shared by the operator (to render) and the runtime (to run).

Torch-free and FastAPI-free by design (import-linter enforces it): the operator image installs
neither.
"""

from omnimodel_runtime.pipeline.files import (
    StageFiles,
    StageFilesError,
    checkpoint_index,
    needs_weight_map,
    select_files,
)
from omnimodel_runtime.pipeline.graph import (
    ENGINE_TASKS,
    PIPELINE_FILE_VERSION,
    AcceleratorRequest,
    EngineName,
    InputModality,
    Modality,
    ModelSource,
    Pipeline,
    PipelineError,
    Route,
    Stage,
    StageKind,
    Vendor,
    default_routes,
    load_pipeline,
    parse_pipeline,
    validation_problems,
)
from omnimodel_runtime.pipeline.presets import PRESETS, get_preset

__all__ = [
    "ENGINE_TASKS",
    "PIPELINE_FILE_VERSION",
    "PRESETS",
    "AcceleratorRequest",
    "EngineName",
    "InputModality",
    "Modality",
    "ModelSource",
    "Pipeline",
    "PipelineError",
    "Route",
    "Stage",
    "StageFiles",
    "StageFilesError",
    "StageKind",
    "Vendor",
    "checkpoint_index",
    "default_routes",
    "get_preset",
    "load_pipeline",
    "needs_weight_map",
    "parse_pipeline",
    "select_files",
    "validation_problems",
]
