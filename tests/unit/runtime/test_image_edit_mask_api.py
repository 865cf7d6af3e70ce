"""``/v1/images/edits`` with a ``mask``, without a model: OpenAI's mask (a PNG whose fully transparent
pixels are where to edit) checked from its header in the gateway, converted to diffusers' convention
(white = repaint) by the entry stage, ``strength`` honoured only with a mask, and every bad mask or
strength a 400 naming the field, through the official ``openai`` client."""

from __future__ import annotations

import io
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import openai
import pytest
import pytest_asyncio
from PIL import Image
from pydantic import ValidationError
from runtime_fakes import FakeServe, asgi_client, lifespan, openai_client

from omnimodel_runtime.engines.images import decode_mask
from omnimodel_runtime.errors import StageError
from omnimodel_runtime.pipeline import ModelSource, get_preset
from omnimodel_runtime.protocol.images import ImageEditParams
from omnimodel_runtime.serving.image_files import png_has_alpha


def _file(mode: str, size: tuple[int, int] = (8, 6), fmt: str = "PNG", **save: Any) -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size).save(buffer, format=fmt, **save)
    return buffer.getvalue()


def _rgba(alpha: np.ndarray) -> bytes:
    rgb = np.full((*alpha.shape, 3), 200, dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(np.dstack([rgb, alpha]), mode="RGBA").save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("data", "alpha"),
    [
        (_file("RGBA"), True),
        (_file("LA"), True),
        (_file("P", transparency=0), True),  # a palette's alpha: a tRNS chunk
        (_file("RGB", transparency=(0, 0, 0)), True),  # one transparent colour: a tRNS chunk
        (_file("L", transparency=0), True),
        (_file("RGB"), False),
        (_file("L"), False),
        (_file("P"), False),
        (_file("RGB", fmt="JPEG"), False),
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", False),  # cut short
    ],
    ids=["rgba", "la", "palette-trns", "rgb-trns", "grey-trns", "rgb", "grey", "palette", "jpeg", "truncated"],
)
def test_png_has_alpha_reads_transparency_from_the_header(data: bytes, alpha: bool) -> None:
    assert png_has_alpha(data) is alpha
    if data.startswith(b"\x89PNG") and len(data) > 40:
        # Pillow agrees about what it decodes.
        with Image.open(io.BytesIO(data)) as img:
            assert ("A" in img.getbands() or "transparency" in img.info) is alpha


def test_the_mask_becomes_diffusers_white_where_fully_transparent() -> None:
    alpha = np.array([[0, 1, 128], [254, 255, 0]], dtype=np.uint8)
    mask = decode_mask(np.frombuffer(_rgba(alpha), dtype=np.uint8), "mask", (3, 2))
    assert mask.mode == "L"
    # Only alpha 0 is edited (OpenAI: "fully transparent areas"); partly transparent pixels are kept.
    assert np.array_equal(np.asarray(mask), [[255, 0, 0], [0, 0, 255]])
    # A palette PNG whose transparent entry is index 0: its index-0 pixels are the area to edit.
    palette = Image.new("P", (2, 1))
    palette.putpixel((1, 0), 1)
    buffer = io.BytesIO()
    palette.save(buffer, format="PNG", transparency=0)
    converted = decode_mask(np.frombuffer(buffer.getvalue(), dtype=np.uint8), "mask", (2, 1))
    assert np.array_equal(np.asarray(converted), [[255, 0]])


@pytest.mark.parametrize(
    ("data", "size", "says"),
    [
        (_file("RGBA", fmt="WEBP", lossless=True), (8, 6), "PNG"),
        (_file("RGB"), (8, 6), "alpha"),
        (_file("RGBA"), (6, 8), "8x6"),
        (b"\x89PNG\r\n\x1a\nbroken", (8, 6), "decode"),
    ],
    ids=["webp", "no-alpha", "other-size", "undecodable"],
)
def test_the_entry_stage_refuses_a_bad_mask_naming_it(data: bytes, size: tuple[int, int], says: str) -> None:
    with pytest.raises(StageError) as err:
        decode_mask(np.frombuffer(data, dtype=np.uint8), "mask", size)
    assert (err.value.status, err.value.param) == (400, "mask")
    assert says in err.value.message


def test_stage_params_take_a_strength_only_with_a_mask() -> None:
    assert ImageEditParams(source_width=8, source_height=6, mask=True, strength=0.3).strength == 0.3
    with pytest.raises(ValidationError, match="without a mask"):
        ImageEditParams(source_width=8, source_height=6, strength=0.3)
    for bad in (0.0, 1.5):
        with pytest.raises(ValidationError):
            ImageEditParams(source_width=8, source_height=6, mask=True, strength=bad)


SOURCE = _file("RGB", (8, 6))
MASK = _file("RGBA", (8, 6))


@pytest_asyncio.fixture
async def serve() -> AsyncIterator[FakeServe]:
    """The qwen-image-edit gateway on fake stages: a request that passes the gateway's checks reaches
    the entry stage (which answers text, so the image answer itself is a 502)."""
    fake = FakeServe(get_preset("qwen-image-edit").pipeline(ModelSource(source="tiny://qwen-image-edit")))
    async with lifespan(fake.app):
        yield fake


async def _refused(serve: FakeServe, **kw: Any) -> str | None:
    async with asgi_client(serve.app) as http:
        with pytest.raises(openai.BadRequestError) as err:
            await openai_client(http).images.edit(prompt="a cat", image=("in.png", SOURCE, "image/png"), **kw)
    body = err.value.body
    assert isinstance(body, dict)
    param: str | None = body["param"]
    return param


@pytest.mark.parametrize(
    "kw",
    [
        {"mask": ("m.jpg", _file("RGB", (8, 6), fmt="JPEG"), "image/jpeg")},
        {"mask": ("m.png", b"not an image", "image/png")},
        {"mask": ("m.png", _file("RGB", (8, 6)), "image/png")},
        {"mask": ("m.png", _file("RGBA", (6, 8)), "image/png")},
        {"mask": ("m.png", _file("RGBA", (9000, 6)), "image/png")},
    ],
    ids=["jpeg", "not-an-image", "no-alpha", "other-size", "too-large"],
)
async def test_a_bad_mask_is_a_400_naming_mask(serve: FakeServe, kw: dict[str, Any]) -> None:
    assert await _refused(serve, **kw) == "mask"
    assert serve.engine.requests == []


async def test_two_masks_are_a_400_naming_mask(serve: FakeServe) -> None:
    async with asgi_client(serve.app) as http:
        resp = await http.post(
            "/v1/images/edits",
            data={"prompt": "a cat"},
            files=[("image", ("in.png", SOURCE, "image/png")), ("mask", ("a.png", MASK)), ("mask", ("b.png", MASK))],
        )
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "mask"


@pytest.mark.parametrize(
    ("strength", "mask"),
    [(1.5, True), (0.0, True), (-0.2, True), (0.5, False)],
    ids=["above-1", "zero", "negative", "partial-without-mask"],
)
async def test_a_bad_strength_is_a_400_naming_strength(serve: FakeServe, strength: float, mask: bool) -> None:
    kw: dict[str, Any] = {"mask": ("m.png", MASK, "image/png")} if mask else {}
    assert await _refused(serve, extra_body={"strength": strength}, **kw) == "strength"


async def test_a_masked_edit_reaches_the_entry_stage_with_its_mask_and_strength(serve: FakeServe) -> None:
    async with asgi_client(serve.app) as http:
        with pytest.raises(openai.APIStatusError):  # the fake stages answer no image
            await openai_client(http).images.edit(
                prompt="a cat",
                image=("in.png", SOURCE, "image/png"),
                mask=("m.png", MASK, "image/png"),
                extra_body={"strength": 0.25},
            )
    (inp,) = serve.engine.requests
    assert [(m.tensor, m.param, m.format) for m in inp.request.media] == [
        ("image", "image", "image/png"),
        ("mask", "mask", "image/png"),
    ]
    assert inp.tensors["mask"].tobytes() == MASK
    assert inp.request.params.edit == ImageEditParams(source_width=8, source_height=6, mask=True, strength=0.25)
