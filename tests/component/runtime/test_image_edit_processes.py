"""Image edits through a real ``omnimodel serve --preset qwen-image-edit --model tiny://qwen-image-edit``
process on loopback, driven by the official ``openai`` client (``images.edit``, a multipart form): PNGs of
the requested size, diffusers' own pixels for the same seed, and bad input refused with a 400 naming the
field."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from runtime_procs import images_api_pixels, openai_client, random_png, running, runtime_env, serve_process
from stage_engines import diffusers_images, diffusers_pipeline

pytestmark = [pytest.mark.engine]

MODEL = "qwen-image-edit"
STEPS = 2


def _diffusers(model_dir: Path, image: bytes, prompt: str, *, seed: int, width: int, height: int) -> np.ndarray:
    from PIL import Image

    from omnimodel_runtime.engines.t2i.qwen_image import load_qwen_vl_processor

    pipe = diffusers_pipeline(
        "QwenImageEditPipeline", model_dir, processor=load_qwen_vl_processor(model_dir / "processor")
    )
    picture = Image.open(io.BytesIO(image)).convert("RGB")
    return diffusers_images(pipe, prompt, seed=seed, steps=STEPS, image=picture, width=width, height=height)[0]


@pytest.mark.slow
def test_serve_answers_the_openai_images_edit_api(tmp_path: Path, model_cache: Path, tiny_edit: Path) -> None:
    serve = serve_process(MODEL, tmp_path, runtime_env(model_cache, OMP_NUM_THREADS=2))
    source, prompt = random_png(40, 56, seed=1), "make the cat blue"
    with running(serve):
        serve.wait_healthy(timeout=300)
        client = openai_client(serve.url)

        def edit(image: bytes, seed: int, **kw: Any) -> list[np.ndarray]:
            result = client.images.edit(
                image=("in.png", image, "image/png"),
                prompt=prompt,
                extra_body={"num_inference_steps": STEPS, "seed": seed},
                **kw,
            )
            return images_api_pixels(result)  # checked: PNG files

        (pixels,) = edit(source, 7, size="48x32")
        assert pixels.shape == (32, 48, 3)
        assert np.array_equal(pixels, _diffusers(tiny_edit, source, prompt, seed=7, width=48, height=32))
        two = edit(source, 7, size="48x32", n=2)
        assert np.array_equal(two[0], pixels)  # image i of a request is seed + i
        assert not np.array_equal(two[1], pixels)
        assert not np.array_equal(edit(random_png(40, 56, seed=2), 7, size="48x32")[0], pixels)

        def refused(**kw: Any) -> str | None:
            with pytest.raises(openai.BadRequestError) as err:
                client.images.edit(prompt=kw.pop("prompt", prompt), **kw)
            body = err.value.body
            assert isinstance(body, dict)
            param: str | None = body["param"]
            return param

        image = ("in.png", source, "image/png")
        assert refused(image=("x.png", b"not an image at all", "image/png")) == "image"
        assert refused(image=image, size="big") == "size"
        assert refused(image=image, size="40x40") == "size"  # not a multiple of 16
        assert refused(image=image, mask=("m.png", source, "image/png")) == "mask"  # RGB: no alpha to mark the edit
        assert refused(image=[image, image]) == "image"
        assert refused(image=image, prompt=" ") == "prompt"
        assert refused(image=image, extra_body={"strength": 0.5}) == "strength"
        # Too big: a small file of a 9000x8 picture, past the largest side accepted.
        assert refused(image=("wide.png", random_png(9000, 8, seed=3), "image/png")) == "image"

        # Text to image is not served by an edit model, and edits are not served by the others.
        assert httpx.post(f"{serve.url}/v1/images/generations", json={"prompt": "a cat"}).status_code == 404
