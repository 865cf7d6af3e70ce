"""Image edits asked for in chat, as vLLM-Omni's image-edit client asks
(examples/online_serving/image_to_image/openai_chat_client.py: the prompt as a text part, the image as an
``image_url`` data URL, the generation parameters in a nested ``extra_body``), on ``omnimodel serve
--preset qwen-image-edit``'s app in process: the edited image is the one ``/v1/images/edits`` makes of the
same image, prompt and seed (the official ``openai`` client's ``images.edit``), and a chat without exactly
one image is a 400 naming what is wrong."""

from __future__ import annotations

import base64
import io
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from PIL import Image
from runtime_procs import Served, serve_fixture

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="module")]

MODEL = "qwen-image-edit"
PROMPT = "Convert to watercolor style"


def png(width: int, height: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def client_payload(image: bytes, *, seed: int, steps: int = 2) -> dict[str, Any]:
    """What vLLM-Omni's image-edit client posts (``--steps``, ``--seed``; it sends no model)."""
    content = [{"type": "text", "text": PROMPT}, {"type": "image_url", "image_url": {"url": data_url(image)}}]
    return {
        "messages": [{"role": "user", "content": content}],
        "extra_body": {"num_inference_steps": steps, "guidance_scale": 7.5, "seed": seed},
    }


def pixels(png_bytes: bytes) -> np.ndarray:
    assert png_bytes.startswith(b"\x89PNG\r\n\x1a\n")
    return np.asarray(Image.open(io.BytesIO(png_bytes)))


serve = serve_fixture(MODEL, "tiny_edit")


@pytest.fixture
def http(serve: Served) -> httpx.AsyncClient:
    return serve.http


@pytest.mark.slow
async def test_vllm_omnis_image_edit_client_gets_the_images_edit_image(http: httpx.AsyncClient) -> None:
    source = png(40, 56, seed=1)
    resp = await http.post("/v1/chat/completions", json=client_payload(source, seed=7))
    assert resp.status_code == 200, resp.text
    # What the client reads: the first content part's image_url data URL.
    url = resp.json()["choices"][0]["message"]["content"][0]["image_url"]["url"]
    assert url.startswith("data:image/png;base64,")
    chat = pixels(base64.b64decode(url.split(",", 1)[1]))
    # The images API on the same image, prompt and parameters.
    sdk = openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="unused", http_client=http, max_retries=0)
    edited = await sdk.images.edit(
        image=("in.png", source, "image/png"),
        prompt=PROMPT,
        extra_body={"num_inference_steps": 2, "guidance_scale": 7.5, "seed": 7},
    )
    assert edited.data is not None and edited.data[0].b64_json is not None
    assert np.array_equal(chat, pixels(base64.b64decode(edited.data[0].b64_json)))
    # Another seed, another image: the seed reached the edit.
    other = await http.post("/v1/chat/completions", json=client_payload(source, seed=8))
    other_url = other.json()["choices"][0]["message"]["content"][0]["image_url"]["url"]
    assert not np.array_equal(chat, pixels(base64.b64decode(other_url.split(",", 1)[1])))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("content", "param", "message"),
    [
        ([{"type": "text", "text": PROMPT}], "messages", "needs an input image"),
        (
            [
                {"type": "text", "text": PROMPT},
                {"type": "image_url", "image_url": {"url": data_url(png(8, 8, 1))}},
                {"type": "image_url", "image_url": {"url": data_url(png(8, 8, 2))}},
            ],
            "messages[0].content[2]",
            "one image per request",
        ),
        (
            [{"type": "text", "text": PROMPT}, {"type": "image_url", "image_url": {"url": data_url(b"not a png")}}],
            "messages[0].content[1]",
            "not a PNG, JPEG or WebP image",
        ),
        (
            [
                {"type": "text", "text": PROMPT},
                {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
            ],
            "messages[0].content[1]",
            "does not take audio",
        ),
    ],
    ids=["no-image", "two-images", "not-an-image", "audio"],
)
async def test_a_chat_edit_without_exactly_one_image_is_a_400_naming_it(
    http: httpx.AsyncClient, content: list[dict[str, Any]], param: str, message: str
) -> None:
    resp = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}]})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["param"], error["type"]) == (param, "invalid_request_error")
    assert message in error["message"]
