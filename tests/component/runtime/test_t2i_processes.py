"""Text-to-image as real processes on loopback, driven by the official ``openai`` client:
``omnimodel serve --preset text-to-image --model tiny://text-to-image``, and three ``omnimodel stage``
processes (encode, denoise, decode) behind ``omnimodel gateway``, whose images must be diffusers' own
pixels for the same seed.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import torch
from PIL import Image
from runtime_procs import RuntimeProcess, free_port, running, runtime_env

from omnimodel_runtime.serve import serve_pipeline

pytestmark = [pytest.mark.engine, pytest.mark.slow]

MODEL = "text-to-image"
# One intra-op thread per process: four runtime processes share a small box.
THREADS = {"OMP_NUM_THREADS": 1}


@pytest.fixture(scope="module")
def tiny_t2i(model_cache: Path) -> Path:
    from omnimodel_runtime.tiny import ensure_tiny

    return ensure_tiny("text-to-image", model_cache)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _images(result: Any) -> list[np.ndarray]:
    assert result.data is not None
    return [np.asarray(Image.open(io.BytesIO(base64.b64decode(d.b64_json)))) for d in result.data]


def test_serve_answers_the_openai_images_api(tmp_path: Path, model_cache: Path, tiny_t2i: Path) -> None:
    serve = RuntimeProcess(
        "serve",
        ["serve", "--preset", MODEL, "--model", f"tiny://{MODEL}"],
        log_dir=tmp_path,
        env=runtime_env(model_cache, **THREADS),
        port=free_port(),
    )
    with running(serve):
        serve.wait_healthy()
        client = _client(serve.url)
        assert [m.id for m in client.models.list().data] == [MODEL]

        def generate(n: int, seed: int) -> list[np.ndarray]:
            result = client.images.generate(
                model=MODEL,
                prompt="a watercolor fox in the snow",
                n=n,
                size="48x32",  # type: ignore[arg-type]
                response_format="b64_json",
                extra_body={"seed": seed, "num_inference_steps": 4},
            )
            return _images(result)

        two = generate(2, seed=21)
        assert [im.shape for im in two] == [(32, 48, 3), (32, 48, 3)]
        assert not np.array_equal(two[0], two[1])
        again = generate(1, seed=21)
        assert np.array_equal(again[0], two[0])  # a fixed seed repeats exactly
        assert np.array_equal(generate(1, seed=22)[0], two[1])  # image i of a request is seed + i

        reply = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "a watercolor fox in the snow"}],
            extra_body={"seed": 21, "size": "48x32", "num_inference_steps": 4},
        )
        content: Any = reply.choices[0].message.content
        url = content[0]["image_url"]["url"]
        assert url.startswith("data:image/png;base64,")
        chat_image = np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))))
        assert np.array_equal(chat_image, two[0])

        with pytest.raises(openai.BadRequestError) as err:
            client.images.generate(model=MODEL, prompt="x", size="1024x")  # type: ignore[arg-type]
        assert err.value.body is not None
        assert err.value.body["param"] == "size"  # type: ignore[index]


def test_three_stage_processes_give_the_diffusers_pipelines_pixels(
    tmp_path: Path, model_cache: Path, tiny_t2i: Path
) -> None:
    ports = {name: free_port() for name in ("encode", "denoise", "decode")}
    pipeline = serve_pipeline(MODEL, f"tiny://{MODEL}", device="cpu")
    stages = tuple(s.model_copy(update={"endpoints": (f"http://127.0.0.1:{ports[s.name]}",)}) for s in pipeline.stages)
    path = tmp_path / "pipeline.json"
    path.write_text(pipeline.model_copy(update={"stages": stages}).to_json())
    env = runtime_env(model_cache, OMNIMODEL_HEALTH_INTERVAL=0.5, **THREADS)
    procs = [
        RuntimeProcess(name, ["stage", "--pipeline", str(path), "--stage", name], log_dir=tmp_path, env=env, port=port)
        for name, port in ports.items()
    ]
    gateway = RuntimeProcess(
        "gateway", ["gateway", "--pipeline", str(path)], log_dir=tmp_path, env=env, port=free_port()
    )
    with running(*procs, gateway):
        for proc in (*procs, gateway):
            proc.wait_healthy()
        result = _client(gateway.url).images.generate(
            model=MODEL,
            prompt="a castle on a mountain at sunset",
            n=2,
            size="32x48",  # type: ignore[arg-type]
            extra_body={"seed": 5, "num_inference_steps": 4, "negative_prompt": "blurry", "true_cfg_scale": 2.0},
        )
        served = _images(result)

    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(tiny_t2i)
    pipe.set_progress_bar_config(disable=True)
    expected = pipe(
        "a castle on a mountain at sunset",
        negative_prompt="blurry",
        true_cfg_scale=2.0,
        num_images_per_prompt=2,
        width=32,
        height=48,
        num_inference_steps=4,
        generator=[torch.Generator().manual_seed(5), torch.Generator().manual_seed(6)],
    ).images
    assert [im.shape for im in served] == [(48, 32, 3), (48, 32, 3)]
    for got, want in zip(served, expected, strict=True):
        assert np.array_equal(got, np.asarray(want))
