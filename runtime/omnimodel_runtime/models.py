"""Resolve a pipeline's model source to a local directory an engine can load."""

from __future__ import annotations

from pathlib import Path

from omnimodel_runtime.errors import ModelSourceError
from omnimodel_runtime.pipeline import ModelSource, Stage
from omnimodel_runtime.settings import RuntimeSettings


def resolve_model_dir(source: ModelSource, settings: RuntimeSettings, stage: Stage | None = None) -> Path:
    """A local directory with the model's files (for ``stage``: the files it reads).

    - ``tiny://<preset>``: built on first use under the model cache, reused afterwards.
    - ``file:///abs/path``: used as is.
    - ``pvc://claim/path``: ``<pvc_root>/<claim>/<path>`` (where the claim is mounted).
    - ``hf://org/name``: from the Hugging Face hub cache (``HF_HUB_CACHE``, default ``$HF_HOME/hub``).
      When ``omnimodel fetch`` completed the revision there (its marker), a directory of the stage's own
      files, without the network; otherwise only the stage's files are downloaded first (the whole
      repository for ``stage=None``). With ``HF_HUB_OFFLINE`` and no marker, a pre-filled cache's snapshot.
      See :mod:`omnimodel_runtime.fetch`.
    """
    scheme, _, rest = source.source.partition("://")
    if scheme == "tiny":
        from omnimodel_runtime.tiny import ensure_tiny  # noqa: PLC0415  (torch only when needed)

        return ensure_tiny(rest.strip("/"), settings.model_cache)
    if scheme == "file":
        path = Path(rest) if rest.startswith("/") else Path("/" + rest)
        return _existing(path, source)
    if scheme == "pvc":
        claim, _, sub = rest.partition("/")
        return _existing(settings.pvc_root / claim / sub, source)
    if scheme == "hf":
        from omnimodel_runtime.fetch import stage_model_dir  # noqa: PLC0415  (huggingface_hub only when needed)

        return stage_model_dir(source, stage)
    raise ModelSourceError(f"unsupported model source scheme {scheme!r} in {source.source}")


def _existing(path: Path, source: ModelSource) -> Path:
    if not path.is_dir():
        raise ModelSourceError(f"model source {source.source} resolves to {path}, which is not a directory")
    return path
