"""``/v1/images/edits`` without a model: the file header check and where the route is served."""

from __future__ import annotations

import io

import pytest
from PIL import Image
from runtime_fakes import FakeServe, asgi_client, lifespan

from omnimodel_runtime.serve import build_serve_app, serve_pipeline
from omnimodel_runtime.serving.image_files import image_info
from omnimodel_runtime.settings import RuntimeSettings


def _file(fmt: str, size: tuple[int, int], **save: object) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (10, 200, 30)).save(buffer, format=fmt, **save)
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("fmt", "save", "mime"),
    [
        ("PNG", {}, "image/png"),
        ("JPEG", {}, "image/jpeg"),
        ("JPEG", {"progressive": True}, "image/jpeg"),
        ("WEBP", {"lossless": True}, "image/webp"),
        ("WEBP", {"quality": 80}, "image/webp"),
    ],
    ids=["png", "jpeg", "jpeg-progressive", "webp-lossless", "webp-lossy"],
)
@pytest.mark.parametrize("size", [(1, 1), (57, 31), (3000, 2)])
def test_image_info_reads_the_size_pillow_reads(
    fmt: str, save: dict[str, object], mime: str, size: tuple[int, int]
) -> None:
    assert image_info(_file(fmt, size, **save)) == (mime, *size)


@pytest.mark.parametrize(
    "data", [b"", b"GIF89a....", b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff\xe0\x00", b"RIFF\x00\x00\x00\x00WEBPVP8 "]
)
def test_image_info_refuses_what_is_not_a_readable_header(data: bytes) -> None:
    assert image_info(data) is None


async def test_the_edits_route_exists_only_where_the_pipeline_edits() -> None:
    text = FakeServe()
    async with lifespan(text.app), asgi_client(text.app) as http:
        resp = await http.post(
            "/v1/images/edits", files={"image": ("a.png", _file("PNG", (8, 8)))}, data={"prompt": "x"}
        )
        assert resp.status_code == 404
    for preset, served in [("text-to-image", False), ("qwen-image-edit", True)]:
        app = build_serve_app(RuntimeSettings(), serve_pipeline(preset, f"tiny://{preset}", device="cpu"))
        assert ("/v1/images/edits" in app.openapi()["paths"]) is served
        assert ("/v1/images/generations" in app.openapi()["paths"]) is not served
