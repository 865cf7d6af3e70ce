"""Assembling gateway processes: the OpenAI app over remote stages (``omnimodel gateway``) or over
in-process stages (``omnimodel serve``)."""

from omnimodel_runtime.gateway.assemble import build_gateway_app, build_serve_app, serve_pipeline

__all__ = ["build_gateway_app", "build_serve_app", "serve_pipeline"]
