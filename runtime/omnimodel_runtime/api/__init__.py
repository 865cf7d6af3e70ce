"""The OpenAI-compatible HTTP API: thin routes over :mod:`omnimodel_runtime.serving`."""

from omnimodel_runtime.api.app import build_app

__all__ = ["build_app"]
