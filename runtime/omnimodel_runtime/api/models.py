"""``GET /v1/models``: the one model this gateway serves."""

from __future__ import annotations

from typing import Annotated, Final

from fastapi import APIRouter, Depends

from omnimodel_runtime.api.auth import require_key
from omnimodel_runtime.api.openapi import errors
from omnimodel_runtime.api.state import APIState, api_state
from omnimodel_runtime.protocol.openai import ModelCard, ModelList

PATH: Final = "/v1/models"

router = APIRouter(dependencies=[Depends(require_key)])


@router.get(PATH, responses=errors(401, 500))
async def list_models(api: Annotated[APIState, Depends(api_state)]) -> ModelList:
    max_len = api.orchestrator.handles[api.pipeline.entry.name].max_model_len
    return ModelList(data=[ModelCard(id=api.pipeline.model.name, max_model_len=max_len)])
