"""The diffusers pipeline classes the image engine splits, and the family of the pipeline in a model
directory."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from omnimodel_runtime.engines.t2i.family import Family, read_config
from omnimodel_runtime.engines.t2i.flux import FluxFamily
from omnimodel_runtime.engines.t2i.qwen_image import QwenImageEditFamily, QwenImageFamily

FAMILIES: Final[Mapping[str, Family]] = {
    f.pipeline_class: f for f in (QwenImageFamily(), QwenImageEditFamily(), FluxFamily())
}


def family_for(model_dir: Path) -> tuple[Family, dict[str, Any]]:
    """The family of the pipeline in ``model_dir`` (by ``model_index.json``'s class) and that index."""
    index = read_config(model_dir / "model_index.json")
    name = str(index.get("_class_name", ""))
    family = FAMILIES.get(name)
    if family is None:
        known = ", ".join(FAMILIES)
        raise ValueError(f"{model_dir} holds a {name or 'unknown'} pipeline; the diffusers engine splits {known}")
    return family, index
