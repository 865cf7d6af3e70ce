"""OmniModel operator: turns an OmniModel custom resource into per-stage Kubernetes workloads.

Never imports torch, FastAPI or an engine: the only runtime module it uses is the torch-free
pipeline contract (enforced by import-linter).
"""

__version__ = "0.1.0"
