"""Engine adapters behind one interface (:class:`~omnimodel_runtime.engines.base.Engine`), grouped by
family: ``text/``, ``omni/``, ``tts/``, ``t2i/``.

Adapters are imported lazily through :mod:`omnimodel_runtime.engines.registry`: importing this package
pulls in no inference library.
"""

from omnimodel_runtime.engines.base import Engine, EngineContext, EngineMetrics, NullMetrics
from omnimodel_runtime.engines.registry import create_engine, engine_class

__all__ = ["Engine", "EngineContext", "EngineMetrics", "NullMetrics", "create_engine", "engine_class"]
