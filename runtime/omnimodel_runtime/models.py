"""Resolve a pipeline's model source to a local directory an engine can load."""

from __future__ import annotations

from pathlib import Path

from omnimodel_runtime.errors import ExtraMissingError, ModelSourceError
from omnimodel_runtime.pipeline import ModelSource
from omnimodel_runtime.settings import RuntimeSettings


def resolve_model_dir(source: ModelSource, settings: RuntimeSettings) -> Path:
    """A local directory with the model's files.

    - ``tiny://<preset>``: built on first use under the model cache, reused afterwards.
    - ``file:///abs/path``: used as is.
    - ``pvc://claim/path``: ``<pvc_root>/<claim>/<path>`` (where the claim is mounted).
    - ``hf://org/name``: a snapshot through the Hugging Face cache (``HF_HOME``); honours
      ``HF_HUB_OFFLINE``, so a pre-filled cache works without network.
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
        try:
            from huggingface_hub import snapshot_download  # noqa: PLC0415  (optional dependency)
        except ImportError as err:
            raise ExtraMissingError(what="hf:// model sources", extra="transformers", cause=err) from err
        try:
            return Path(snapshot_download(repo_id=rest.strip("/"), revision=source.revision))
        except Exception as err:
            raise ModelSourceError(f"cannot fetch {source.source}: {err}") from err
    raise ModelSourceError(f"unsupported model source scheme {scheme!r} in {source.source}")


def _existing(path: Path, source: ModelSource) -> Path:
    if not path.is_dir():
        raise ModelSourceError(f"model source {source.source} resolves to {path}, which is not a directory")
    return path
