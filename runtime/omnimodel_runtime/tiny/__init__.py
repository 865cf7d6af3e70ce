"""Tiny random-weight models for every preset: real architecture classes, small configs, built offline.

``tiny://<preset>`` model sources resolve here. Builders are registered by preset name and imported
lazily (they need torch and transformers); :func:`ensure_tiny` builds a model once into the model cache
and reuses it afterwards.
"""

from omnimodel_runtime.tiny.cache import ensure_tiny, tiny_cache_dir
from omnimodel_runtime.tiny.registry import TINY_BUILDERS, TinyBuilder, build_tiny, tiny_presets

__all__ = ["TINY_BUILDERS", "TinyBuilder", "build_tiny", "ensure_tiny", "tiny_cache_dir", "tiny_presets"]
