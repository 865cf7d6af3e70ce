"""``/v1/videos``: OpenAI's video jobs (create, retrieve, list, download the MP4, delete)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Final, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response
from pydantic import ValidationError
from starlette.datastructures import UploadFile

from omnimodel_runtime.api.auth import require_key
from omnimodel_runtime.api.openapi import STAGE_ERRORS, binary, errors, form_schema, ok
from omnimodel_runtime.api.state import APIState, api_state
from omnimodel_runtime.protocol.videos import VideoCreateRequest, VideoDeleted, VideoList, VideoObject
from omnimodel_runtime.serving.errors import APIError, invalid

PATH: Final = "/v1/videos"
# A create form has a dozen fields; more parts than this is not a client of this API.
MAX_FORM_PARTS: Final = 64

router = APIRouter(dependencies=[Depends(require_key)])

_CREATE_SCHEMA: Final[dict[str, Any]] = VideoCreateRequest.model_json_schema()
_CREATE_FORM: Final[dict[str, Any]] = form_schema(VideoCreateRequest, files={}, required=("prompt",))


async def _create_fields(request: Request) -> dict[str, Any]:
    """The create body as a mapping: JSON, or the multipart (or urlencoded) form the openai client sends."""
    kind = request.headers.get("content-type", "")
    if kind.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
        fields: dict[str, Any] = {}
        async with request.form(max_files=MAX_FORM_PARTS, max_fields=MAX_FORM_PARTS) as form:
            for name, value in form.multi_items():
                if isinstance(value, UploadFile):
                    raise APIError(f"{name}: this model makes videos from text alone and takes no file", param=name)
                if name in fields:
                    raise APIError(f"{name}: given more than once", param=name)
                fields[name] = value
        return fields
    try:
        body = json.loads(await request.body())
    except ValueError as err:
        raise APIError(f"the request body is not valid JSON: {err}", param=None) from None
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object", param=None)
    return body


@router.post(
    PATH,
    response_model=VideoObject,
    responses=ok("The job, queued (poll `GET /v1/videos/{video_id}`)") | errors(*STAGE_ERRORS, 429),
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": _CREATE_SCHEMA},
                "multipart/form-data": {"schema": _CREATE_FORM},
            },
        }
    },
)
async def create_video(request: Request, api: Annotated[APIState, Depends(api_state)]) -> VideoObject:
    """The body is read here (not declared as a FastAPI parameter) because it comes as JSON or as a form."""
    fields = await _create_fields(request)
    try:
        body = VideoCreateRequest.model_validate(fields)
    except ValidationError as err:
        raise invalid(err) from None
    return await api.videos.create(body)


@router.get(PATH, response_model=VideoList, responses=ok("The jobs, newest first by default") | errors(400, 401))
async def list_videos(
    api: Annotated[APIState, Depends(api_state)],
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
) -> VideoList:
    return api.videos.list(after=after, limit=limit, order=order)


@router.get(PATH + "/{video_id}", response_model=VideoObject, responses=ok("The job's status") | errors(401, 404))
async def retrieve_video(video_id: str, api: Annotated[APIState, Depends(api_state)]) -> VideoObject:
    return api.videos.retrieve(video_id)


@router.get(
    PATH + "/{video_id}/content",
    response_class=Response,
    responses=binary(("video/mp4",), "The MP4 file (H.264)") | errors(400, 401, 404, 409),
)
async def video_content(
    video_id: str,
    api: Annotated[APIState, Depends(api_state)],
    variant: Literal["video"] = "video",
) -> Response:
    """Only the ``video`` variant: this pipeline makes no thumbnail or spritesheet."""
    return Response(api.videos.content(video_id), media_type="video/mp4")


@router.delete(
    PATH + "/{video_id}", response_model=VideoDeleted, responses=ok("The job is forgotten") | errors(401, 404)
)
async def delete_video(video_id: str, api: Annotated[APIState, Depends(api_state)]) -> VideoDeleted:
    return await api.videos.delete(video_id)
