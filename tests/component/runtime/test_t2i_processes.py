"""Text-to-image as real processes on loopback, driven by the official ``openai`` client:
``omnimodel serve --preset text-to-image --model tiny://text-to-image``, and three ``omnimodel stage``
processes (encode, denoise, decode) behind ``omnimodel gateway``, whose images must be diffusers' own
pixels for the same seed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from runtime_procs import (
    images_api_pixels,
    openai_client,
    png_pixels,
    running,
    runtime_env,
    serve_process,
    split_deployment,
)
from stage_engines import diffusers_images, diffusers_pipeline

from omnimodel_runtime.serve import serve_pipeline

pytestmark = [pytest.mark.engine]

MODEL = "text-to-image"
# One intra-op thread per process: four runtime processes share a small box.
THREADS = {"OMP_NUM_THREADS": 1}


@pytest.mark.slow
def test_serve_answers_the_openai_images_api(tmp_path: Path, model_cache: Path, tiny_t2i: Path) -> None:
    serve = serve_process(MODEL, tmp_path, runtime_env(model_cache, **THREADS))
    with running(serve):
        serve.wait_healthy()
        client = openai_client(serve.url)
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
            return images_api_pixels(result)

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
        chat_image = png_pixels(url.split(",", 1)[1])
        assert np.array_equal(chat_image, two[0])

        with pytest.raises(openai.BadRequestError) as err:
            client.images.generate(model=MODEL, prompt="x", size="1024x")  # type: ignore[arg-type]
        assert err.value.body is not None
        assert err.value.body["param"] == "size"  # type: ignore[index]


@pytest.mark.slow
def test_three_stage_processes_give_the_diffusers_pipelines_pixels(
    tmp_path: Path, model_cache: Path, tiny_t2i: Path
) -> None:
    pipeline = serve_pipeline(MODEL, f"tiny://{MODEL}", device="cpu")
    env = runtime_env(model_cache, OMNIMODEL_HEALTH_INTERVAL=0.5, **THREADS)
    prompt, cfg = "a castle on a mountain at sunset", {"negative_prompt": "blurry", "true_cfg_scale": 2.0}
    with split_deployment(pipeline, tmp_path, env) as procs:
        result = openai_client(procs["gateway"].url).images.generate(
            model=MODEL,
            prompt=prompt,
            n=2,
            size="32x48",  # type: ignore[arg-type]
            extra_body={"seed": 5, "num_inference_steps": 4, **cfg},
        )
        served = images_api_pixels(result)

    pipe = diffusers_pipeline("QwenImagePipeline", tiny_t2i)
    expected = diffusers_images(pipe, prompt, seed=5, steps=4, n=2, width=32, height=48, **cfg)
    assert [im.shape for im in served] == [(48, 32, 3), (48, 32, 3)]
    for got, want in zip(served, expected, strict=True):
        assert np.array_equal(got, want)
