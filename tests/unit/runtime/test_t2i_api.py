"""``/v1/images/generations`` and image chat on the text-to-image preset, against fake stage engines.

The fakes have the real preset's shape (encode → denoise → decode, tensors handed along the chain) and
paint each image a colour derived from its seed, so the tests see what a client sees: PNGs of the
requested size, one per requested image, the same pixels for the same seed, and a 400 naming the field
for bad input before any stage does work.
"""

from __future__ import annotations

import base64
import io
from collections.abc import AsyncIterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from PIL import Image
from prometheus_client import CollectorRegistry
from runtime_fakes import FakeServe, asgi_client, fake_context, lifespan, openai_client

from omnimodel_runtime.engines.base import Engine
from omnimodel_runtime.errors import StageError
from omnimodel_runtime.gateway import build_app
from omnimodel_runtime.metrics import StageMetricsFamily
from omnimodel_runtime.pipeline import ModelSource, Pipeline, get_preset
from omnimodel_runtime.protocol.images import IMAGES_TENSOR, TextToImageParams
from omnimodel_runtime.protocol.stage import FinalFrame, ResponseFrame, StageInput, StageParams, TensorFrame, Usage
from omnimodel_runtime.serving.images import encode_png
from omnimodel_runtime.settings import RuntimeSettings
from omnimodel_runtime.stage.handle import StageHandle
from omnimodel_runtime.stage.local import LocalStage

MODEL = "text-to-image"


class FakeImageStage(Engine):
    """encode: one embedding row per prompt character; denoise: one latent per image, its seed;
    decode: each image filled with ``seed % 251`` in red, its index in green."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.requests: list[StageInput] = []

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def generate(self, inp: StageInput) -> AsyncIterator[ResponseFrame]:
        self.requests.append(inp)
        params = inp.request.params.image
        task = self.stage.task
        if task == "t2i-encode":
            prompt = inp.request.prompt or ""
            yield TensorFrame({"prompt_embeds": np.ones((1, len(prompt), 4), dtype=np.float32)})
            yield FinalFrame("stop", Usage(prompt_tokens=len(prompt)))
            return
        assert inp.upstream is not None
        upstream = [f async for f in inp.upstream]
        assert isinstance(upstream[-1], FinalFrame)
        if task == "t2i-denoise":
            if params.width == 24:
                raise StageError("size must be a multiple of 16", status=400, param="size")
            n, seed = params.n, params.seed or 0
            yield TensorFrame({"latents": np.arange(seed, seed + n, dtype=np.int64)})
        else:
            latents = next(f for f in upstream if isinstance(f, TensorFrame)).tensors["latents"]
            height, width = params.height or 64, params.width or 64
            images = np.zeros((len(latents), height, width, 3), dtype=np.uint8)
            for i, seed in enumerate(latents):
                images[i, ..., 0] = int(seed) % 251
                images[i, ..., 1] = i
            yield TensorFrame({IMAGES_TENSOR: images}, meta={"modality": "image"})
        yield FinalFrame("stop")


class ImageServe:
    def __init__(self) -> None:
        self.pipeline: Pipeline = get_preset(MODEL).pipeline(ModelSource(source=f"tiny://{MODEL}"))
        family = StageMetricsFamily(registry := CollectorRegistry())
        self.engines: dict[str, FakeImageStage] = {}
        handles: dict[str, StageHandle] = {}
        for stage in self.pipeline.stages:
            metrics = family.for_stage(stage.name)
            self.engines[stage.name] = FakeImageStage(fake_context(stage, metrics))
            handles[stage.name] = LocalStage(stage, self.engines[stage.name], metrics)
        self.app = build_app(RuntimeSettings(), self.pipeline, handles, registry=registry)

    def requests(self) -> int:
        return sum(len(e.requests) for e in self.engines.values())


@pytest.fixture
async def serve() -> AsyncIterator[ImageServe]:
    s = ImageServe()
    async with lifespan(s.app):
        yield s


@pytest.fixture
async def http(serve: ImageServe) -> AsyncIterator[httpx.AsyncClient]:
    async with asgi_client(serve.app) as client:
        yield client


@pytest.fixture
def client(http: httpx.AsyncClient) -> openai.AsyncOpenAI:
    return openai_client(http)


def _png(b64: str) -> Image.Image:
    raw = base64.b64decode(b64)
    assert raw.startswith(b"\x89PNG\r\n\x1a\n")
    return Image.open(io.BytesIO(raw))


async def test_openai_client_gets_one_png_per_image_of_the_requested_size(
    client: openai.AsyncOpenAI, serve: ImageServe
) -> None:
    result = await client.images.generate(
        model=MODEL,
        prompt="a red cat",
        n=2,
        size="48x32",  # type: ignore[arg-type]  (any WxH the model supports, not only OpenAI's sizes)
        response_format="b64_json",
        extra_body={"seed": 40, "num_inference_steps": 3, "negative_prompt": "blurry", "true_cfg_scale": 2.5},
    )
    assert result.data is not None
    images = [_png(d.b64_json or "") for d in result.data]
    assert [im.size for im in images] == [(48, 32), (48, 32)]
    pixels = [np.asarray(im) for im in images]
    assert [int(p[0, 0, 0]) for p in pixels] == [40, 41]  # image i is drawn from seed + i
    assert [int(p[0, 0, 1]) for p in pixels] == [0, 1]
    # Every stage got the prompt and the parameters, and nothing it was not sent.
    for engine in serve.engines.values():
        (inp,) = engine.requests
        assert inp.request.prompt == "a red cat"
        assert inp.request.params == StageParams(
            image=TextToImageParams(
                n=2, width=48, height=32, num_inference_steps=3, true_cfg_scale=2.5, negative_prompt="blurry", seed=40
            )
        )


async def test_height_and_width_size_the_images_as_size_does(client: openai.AsyncOpenAI) -> None:
    """OpenAI's API has only ``size``; vLLM-Omni's clients also send ``height`` and ``width`` (as on image
    chat), which are honoured rather than silently ignored."""
    result = await client.images.generate(model=MODEL, prompt="a red cat", extra_body={"height": 32, "width": 48})
    assert result.data is not None
    assert _png(result.data[0].b64_json or "").size == (48, 32)
    assert result.size == "48x32"
    # Sent with size, they must agree with it.
    same = await client.images.generate(
        model=MODEL,
        prompt="a red cat",
        size="48x32",  # type: ignore[arg-type]
        extra_body={"height": 32, "width": 48},
    )
    assert same.data is not None
    assert _png(same.data[0].b64_json or "").size == (48, 32)


async def test_a_fixed_seed_repeats_and_another_seed_differs(client: openai.AsyncOpenAI) -> None:
    async def first_pixel(seed: int) -> int:
        result = await client.images.generate(model=MODEL, prompt="x", size="16x16", extra_body={"seed": seed})  # type: ignore[arg-type]
        assert result.data is not None
        return int(np.asarray(_png(result.data[0].b64_json or ""))[0, 0, 0])

    assert await first_pixel(7) == await first_pixel(7) == 7
    assert await first_pixel(8) == 8


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"size": "1024x"}, "size"),
        ({"size": "0x0"}, "size"),
        ({"size": "big"}, "size"),
        ({"size": "8192x8192"}, "size"),
        ({"num_inference_steps": 0}, "num_inference_steps"),
        ({"num_inference_steps": 201}, "num_inference_steps"),
        ({"n": 0}, "n"),
        ({"n": 11}, "n"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "   "}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"guidance_scale": -1}, "guidance_scale"),
        ({"true_cfg_scale": 21}, "true_cfg_scale"),
        ({"seed": -1}, "seed"),
        ({"response_format": "url"}, "response_format"),
        ({"output_format": "jpeg"}, "output_format"),
        ({"quality": "hd"}, "quality"),
        ({"style": "vivid"}, "style"),
        ({"background": "transparent"}, "background"),
        ({"output_compression": 50}, "output_compression"),
        ({"height": 32}, "width"),
        ({"width": 32}, "width"),
        ({"height": 0, "width": 16}, "height"),
        ({"height": 16, "width": 8192}, "width"),
        ({"size": "48x32", "height": 48, "width": 32}, "width"),
    ],
)
async def test_bad_input_is_a_400_naming_the_field_and_no_stage_runs(
    http: httpx.AsyncClient, serve: ImageServe, body: dict[str, Any], param: str
) -> None:
    resp = await http.post("/v1/images/generations", json={"prompt": "a cat", **body})
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{param}: ")
    assert serve.requests() == 0


async def test_a_stage_refusing_the_request_is_a_400_naming_the_field(http: httpx.AsyncClient) -> None:
    resp = await http.post("/v1/images/generations", json={"prompt": "a cat", "size": "24x24"})
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "size"
    assert "multiple of 16" in resp.json()["error"]["message"]


async def test_another_model_name_is_a_404(http: httpx.AsyncClient) -> None:
    resp = await http.post("/v1/images/generations", json={"prompt": "a cat", "model": "dall-e-3"})
    assert resp.status_code == 404
    assert resp.json()["error"]["code"] == "model_not_found"


async def test_chat_answers_with_image_url_data_urls(client: openai.AsyncOpenAI, serve: ImageServe) -> None:
    reply = await client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "You draw."},
            {"role": "user", "content": "an old photo"},
            {"role": "assistant", "content": "Here."},
            {"role": "user", "content": [{"type": "text", "text": "a green"}, {"type": "text", "text": "fox"}]},
        ],
        n=2,
        seed=3,
        extra_body={"size": "16x24", "num_inference_steps": 2},
    )
    content: Any = reply.choices[0].message.content
    assert isinstance(content, list)
    assert len(content) == 2
    for i, part in enumerate(content):
        assert part["type"] == "image_url"
        prefix, b64 = part["image_url"]["url"].split(",", 1)
        assert prefix == "data:image/png;base64"
        image = np.asarray(_png(b64))
        assert image.shape == (24, 16, 3)
        assert int(image[0, 0, 0]) == 3 + i
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len("a green fox")
    assert serve.engines["encode"].requests[0].request.prompt == "a green fox"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"stream": True}, "stream"),
        ({"modalities": ["text"]}, "modalities"),
        ({"height": 32}, "width"),
        ({"size": "32x32", "width": 16, "height": 16}, "width"),
        ({"size": "32"}, "size"),
        ({"n": 11}, "n"),
        ({"messages": [{"role": "user", "content": " "}]}, "messages"),
        ({"messages": [{"role": "user", "content": "a cat"}] * 2049}, "messages"),
        ({"messages": [{"role": "user", "content": "a cat " * 180_000}]}, "messages"),
    ],
)
async def test_chat_refuses_what_an_image_answer_cannot_do(
    http: httpx.AsyncClient, serve: ImageServe, extra: dict[str, Any], param: str
) -> None:
    body = {"messages": [{"role": "user", "content": "a cat"}], **extra}
    resp = await http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
    assert serve.requests() == 0


async def test_the_images_route_exists_only_where_the_pipeline_serves_images() -> None:
    text = FakeServe()
    async with lifespan(text.app), asgi_client(text.app) as http:
        resp = await http.post("/v1/images/generations", json={"prompt": "a cat"})
        assert resp.status_code == 404
        # Chat on a text pipeline is still text chat.
        chat = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 200
        assert isinstance(chat.json()["choices"][0]["message"]["content"], str)


@pytest.mark.parametrize("shape", [(5, 7, 3), (4, 6, 4), (3, 2), (1, 9, 1)])
def test_png_encoding_round_trips_through_pillow(shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, size=shape, dtype=np.uint8)
    decoded = np.asarray(Image.open(io.BytesIO(encode_png(pixels))))
    assert np.array_equal(decoded, pixels.reshape(decoded.shape))


def test_png_encoding_refuses_what_png_cannot_hold() -> None:
    with pytest.raises(ValueError, match="uint8"):
        encode_png(np.zeros((2, 2, 3), dtype=np.float32))
    with pytest.raises(ValueError, match="shape"):
        encode_png(np.zeros((2, 2, 2), dtype=np.uint8))


# ---------------------------------------------------------------- vLLM-Omni's clients (docs/vllm-omni-compat.md)


def _chat_pixels(reply: dict[str, Any]) -> list[np.ndarray]:
    parts = reply["choices"][0]["message"]["content"]
    return [np.asarray(_png(p["image_url"]["url"].split(",", 1)[1])) for p in parts]


async def test_vllm_omni_chat_client_nested_extra_body_is_honoured(http: httpx.AsyncClient, serve: ImageServe) -> None:
    # examples/online_serving/text_to_image/openai_chat_client.py: plain ``requests``, no model, the
    # diffusion parameters in a nested "extra_body" object of the JSON body.
    def payload(seed: int) -> dict[str, Any]:
        return {
            "messages": [{"role": "user", "content": "a cup of coffee on the table"}],
            "extra_body": {
                "height": 32,
                "width": 48,
                "num_inference_steps": 3,
                "true_cfg_scale": 4.0,
                "seed": seed,
                "negative_prompt": "blurry",
                "num_outputs_per_prompt": 2,
            },
        }

    resp = await http.post("/v1/chat/completions", json=payload(42))
    assert resp.status_code == 200, resp.text
    images = _chat_pixels(resp.json())
    assert [im.shape for im in images] == [(32, 48, 3), (32, 48, 3)]
    assert [int(im[0, 0, 0]) for im in images] == [42, 43]
    (inp,) = serve.engines["denoise"].requests
    assert inp.request.params.image == TextToImageParams(
        n=2, width=48, height=32, num_inference_steps=3, true_cfg_scale=4.0, negative_prompt="blurry", seed=42
    )
    again = _chat_pixels((await http.post("/v1/chat/completions", json=payload(42))).json())
    other = _chat_pixels((await http.post("/v1/chat/completions", json=payload(7))).json())
    assert np.array_equal(again[0], images[0])
    assert not np.array_equal(other[0], images[0])


async def test_diffusion_benchmark_request_is_honoured(http: httpx.AsyncClient, serve: ImageServe) -> None:
    # benchmarks/diffusion_benchmark_serving.py: model and messages at the top, everything else nested.
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Random prompt 0 for benchmarking diffusion models"}],
        "extra_body": {"height": 16, "width": 32, "num_inference_steps": 2, "seed": 5},
    }
    resp = await http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    (image,) = _chat_pixels(resp.json())
    assert image.shape == (16, 32, 3)
    assert int(image[0, 0, 0]) == 5
    assert serve.engines["denoise"].requests[0].request.params.image.num_inference_steps == 2


async def test_images_api_accepts_a_nested_extra_body(http: httpx.AsyncClient, serve: ImageServe) -> None:
    # What ``images.generate(..., extra_body={...})`` means, written out by hand (curl, requests).
    body = {"prompt": "a fox", "size": "16x16", "extra_body": {"seed": 9, "num_inference_steps": 4}}
    resp = await http.post("/v1/images/generations", json=body)
    assert resp.status_code == 200, resp.text
    assert int(np.asarray(_png(resp.json()["data"][0]["b64_json"]))[0, 0, 0]) == 9
    assert serve.engines["denoise"].requests[0].request.params.image.num_inference_steps == 4


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/images/generations", {"prompt": "a", "seed": 1, "extra_body": {"seed": 2}}, "extra_body.seed"),
        ("/v1/images/generations", {"prompt": "a", "extra_body": {"extra_body": {}}}, "extra_body.extra_body"),
        ("/v1/images/generations", {"prompt": "a", "extra_body": {"num_inference_steps": 0}}, "num_inference_steps"),
        ("/v1/images/generations", {"prompt": "a", "extra_body": "seed=1"}, "extra_body"),
        ("/v1/images/generations", {"prompt": "a", "stream": True, "partial_images": 4}, "partial_images"),
        ("/v1/chat/completions", {"extra_body": {"height": 16}}, "width"),
        ("/v1/chat/completions", {"n": 2, "extra_body": {"num_outputs_per_prompt": 3}}, "num_outputs_per_prompt"),
        ("/v1/chat/completions", {"extra_body": {"num_outputs_per_prompt": 11}}, "num_outputs_per_prompt"),
        ("/v1/chat/completions", {"extra_body": {"stream": True}}, "stream"),
    ],
)
async def test_nested_extra_body_is_validated_like_the_top_level(
    http: httpx.AsyncClient, serve: ImageServe, path: str, body: dict[str, Any], param: str
) -> None:
    if path.endswith("chat/completions"):
        body = {"messages": [{"role": "user", "content": "a cat"}], **body}
    resp = await http.post(path, json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
    assert serve.requests() == 0


async def test_openai_image_stream_yields_completed_events(client: openai.AsyncOpenAI) -> None:
    stream = await client.images.generate(
        model=MODEL,
        prompt="a red cat",
        size="32x16",  # type: ignore[arg-type]
        n=2,
        stream=True,
        partial_images=2,
        extra_body={"seed": 11},
    )
    events = [event async for event in stream]
    assert [e.type for e in events] == ["image_generation.completed"] * 2
    images = [np.asarray(_png(e.b64_json)) for e in events]
    assert [im.shape for im in images] == [(16, 32, 3)] * 2
    assert [int(im[0, 0, 0]) for im in images] == [11, 12]
    assert {e.size for e in events} == {"32x16"}


async def test_a_refused_image_stream_is_a_400_not_an_empty_stream(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="multiple of 16"):
        await client.images.generate(model=MODEL, prompt="a cat", size="24x24", stream=True)  # type: ignore[arg-type]
