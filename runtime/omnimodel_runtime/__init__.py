"""OmniModel runtime: stage servers, the OpenAI-compatible gateway and the engines behind them.

Only :mod:`omnimodel_runtime.pipeline` is imported by the operator; it must stay free of torch,
FastAPI and every engine library (enforced by import-linter).
"""

__version__ = "0.1.0"
