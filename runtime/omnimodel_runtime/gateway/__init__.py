"""The ``omnimodel gateway`` process: the OpenAI API over the stages of a pipeline. Torch-free
(import-linter keeps it off engines and inference libraries)."""

from omnimodel_runtime.gateway.app import build_app, build_gateway_app

__all__ = ["build_app", "build_gateway_app"]
