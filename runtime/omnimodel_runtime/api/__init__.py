"""The OpenAI-compatible HTTP API: one ``APIRouter`` per endpoint, thin routes over
:mod:`omnimodel_runtime.serving`. The gateway (:mod:`omnimodel_runtime.gateway.app`) mounts the routers of
what its pipeline serves."""
