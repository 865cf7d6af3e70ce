"""``POST /v1/images/generations`` (PNGs from a text-to-image pipeline) and ``POST /v1/images/edits``
(PNGs from an edit pipeline and an input image, OpenAI's multipart form)."""

from __future__ import annotations

from typing import Annotated, Any, Final

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from starlette.datastructures import UploadFile

from omnimodel_runtime.api.auth import require_key
from omnimodel_runtime.api.openapi import SSE, STAGE_ERRORS, errors, form_schema, ok
from omnimodel_runtime.api.responses import respond, until_disconnect
from omnimodel_runtime.api.state import APIState, api_state
from omnimodel_runtime.protocol.images import ImageEditRequest, ImageGenerationRequest, ImagesResponse
from omnimodel_runtime.serving.errors import APIError
from omnimodel_runtime.serving.images import IMAGE_FIELDS, MASK_FIELD

PATH: Final = "/v1/images/generations"
EDITS_PATH: Final = "/v1/images/edits"
# More parts than an edit form has fields is not a client of this API.
MAX_FORM_PARTS: Final = 64

router = APIRouter(dependencies=[Depends(require_key)])
edits_router = APIRouter(dependencies=[Depends(require_key)])


@router.post(
    PATH,
    response_model=ImagesResponse,
    responses=ok(
        "PNG images as base64 (`data[i].b64_json`); with `stream: true` as server-sent "
        "`image_generation.completed` events, one per image",
        SSE,
    )
    | errors(*STAGE_ERRORS),
)
async def image_generations(
    body: ImageGenerationRequest, request: Request, api: Annotated[APIState, Depends(api_state)]
) -> Response:
    return respond(await until_disconnect(request, api.images.create(body)))


_BINARY: Final = {"type": "string", "format": "binary"}
_EDIT_FORM: Final[dict[str, Any]] = form_schema(
    ImageEditRequest,
    files={
        "image": {**_BINARY, "description": "The image to edit: one PNG, JPEG or WebP file"},
        MASK_FIELD: {
            **_BINARY,
            "description": "Optional: a PNG of the image's size whose fully transparent pixels are the area "
            "to edit (OpenAI's mask); the edit then runs as QwenImageEditInpaintPipeline with `strength`",
        },
    },
    required=("image", "prompt"),
)


@edits_router.post(
    EDITS_PATH,
    response_model=ImagesResponse,
    responses=ok("PNG images as base64 (`data[i].b64_json`)") | errors(*STAGE_ERRORS),
    openapi_extra={
        "requestBody": {"required": True, "content": {"multipart/form-data": {"schema": _EDIT_FORM}}},
    },
)
async def image_edits(request: Request, api: Annotated[APIState, Depends(api_state)]) -> Response:
    """The form is read here (not declared as FastAPI parameters) so that every field error is a 400
    naming the field, an image given as ``image`` or ``image[]`` alike."""
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise APIError("the body must be multipart/form-data (OpenAI's images edit form)", param=None)
    fields: dict[str, str] = {}
    files: dict[str, list[bytes]] = {}
    async with request.form(max_files=MAX_FORM_PARTS, max_fields=MAX_FORM_PARTS) as form:
        for name, value in form.multi_items():
            if isinstance(value, UploadFile):
                if name not in (*IMAGE_FIELDS, MASK_FIELD):
                    raise APIError(f"{name}: unexpected file field (files go in image and mask)", param=name)
                files.setdefault(name, []).append(await value.read())
            elif name in (*IMAGE_FIELDS, MASK_FIELD):
                raise APIError(f"{name}: must be a file, not a text field", param=name)
            elif name in fields:
                raise APIError(f"{name}: given more than once", param=name)
            else:
                fields[name] = value
    return respond(await until_disconnect(request, api.images.edit(fields, files)))
