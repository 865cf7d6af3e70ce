"""vLLM-Omni's own clients, unchanged, against ``omnimodel serve`` (real processes, tiny models): the
request bodies of its text-to-image chat client and curl example, of its diffusion serving benchmark, of
its Qwen2.5-Omni client and of OpenAI's SDK the way its docs use it (docs/vllm-omni-compat.md). Each gets
what it asked for: the size, the steps and the seed honoured, voices it names answered, image streams
served.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from runtime_procs import openai_client, png_pixels, running, runtime_env, serve_process

pytestmark = [pytest.mark.engine]

# One intra-op thread: the box is small and shared.
THREADS = {"OMP_NUM_THREADS": 1}


def _serve(preset: str, tmp: Path, model_cache: Path, **env: Any) -> Iterator[str]:
    proc = serve_process(preset, tmp, runtime_env(model_cache, **THREADS, **env))
    with running(proc):
        proc.wait_healthy(timeout=300)
        yield proc.url


@pytest.fixture(scope="module")
def t2i(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[str]:
    yield from _serve("text-to-image", tmp_path_factory.mktemp("t2i"), model_cache)


def _chat_images(body: dict[str, Any]) -> list[np.ndarray]:
    # What examples/online_serving/text_to_image/openai_chat_client.py (and the curl example) read.
    content = body["choices"][0]["message"]["content"]
    return [png_pixels(part["image_url"]["url"].split(",", 1)[1]) for part in content]


@pytest.mark.slow
def test_text_to_image_chat_client_and_benchmark_get_the_size_steps_and_seed_they_ask_for(t2i: str) -> None:
    def chat_client(seed: int) -> list[np.ndarray]:
        # openai_chat_client.generate_image: no model, parameters in a nested extra_body.
        payload = {
            "messages": [{"role": "user", "content": "a cup of coffee on the table"}],
            "extra_body": {
                "height": 32,
                "width": 48,
                "num_inference_steps": 2,
                "true_cfg_scale": 4.0,
                "seed": seed,
                "num_outputs_per_prompt": 1,
            },
        }
        resp = httpx.post(f"{t2i}/v1/chat/completions", json=payload, timeout=120)
        assert resp.status_code == 200, resp.text
        return _chat_images(resp.json())

    (first,) = chat_client(42)
    assert first.shape == (32, 48, 3)
    (again,) = chat_client(42)
    (other,) = chat_client(43)
    assert np.array_equal(first, again)  # the same seed draws the same image
    assert not np.array_equal(first, other)  # another seed another one

    # benchmarks/diffusion_benchmark_serving.py async_request_chat_completions, --model given.
    bench = {
        "model": "text-to-image",
        "messages": [{"role": "user", "content": "a cup of coffee on the table"}],
        "extra_body": {"height": 32, "width": 48, "num_inference_steps": 2, "seed": 42},
    }
    resp = httpx.post(f"{t2i}/v1/chat/completions", json=bench, timeout=120)
    assert resp.status_code == 200, resp.text
    (benched,) = _chat_images(resp.json())
    assert np.array_equal(benched, first)  # true_cfg_scale without a negative prompt changes nothing

    # Another step count: a different image, so num_inference_steps reached the denoiser.
    bench["extra_body"] = {**bench["extra_body"], "num_inference_steps": 3}
    (more_steps,) = _chat_images(httpx.post(f"{t2i}/v1/chat/completions", json=bench, timeout=120).json())
    assert more_steps.shape == (32, 48, 3)
    assert not np.array_equal(more_steps, first)


@pytest.mark.slow
def test_images_api_with_nested_extra_body_and_stream(t2i: str) -> None:
    # curl-style /v1/images/generations with the extension fields nested as the SDK's extra_body.
    body = {"prompt": "a fox", "size": "32x16", "extra_body": {"seed": 7, "num_inference_steps": 2}}
    resp = httpx.post(f"{t2i}/v1/images/generations", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    nested = png_pixels(resp.json()["data"][0]["b64_json"])
    assert nested.shape == (16, 32, 3)

    with openai_client(t2i) as client:
        flat = client.images.generate(
            prompt="a fox",
            size="32x16",  # type: ignore[arg-type]
            extra_body={"seed": 7, "num_inference_steps": 2},
        )
        assert flat.data is not None
        assert np.array_equal(png_pixels(flat.data[0].b64_json or ""), nested)

        events = list(
            client.images.generate(
                prompt="a fox",
                size="32x16",  # type: ignore[arg-type]
                stream=True,
                extra_body={"seed": 7, "num_inference_steps": 2},
            )
        )
    assert [e.type for e in events] == ["image_generation.completed"]
    assert np.array_equal(png_pixels(events[0].b64_json), nested)


@pytest.mark.slow
def test_speech_takes_openai_voice_names_and_lists_the_voices_otherwise(tmp_path: Path, model_cache: Path) -> None:
    for url in _serve("tts", tmp_path, model_cache):
        with openai_client(url) as client:
            audio = client.audio.speech.create(model="tts", input="Hello there.", voice="alloy", response_format="wav")
            assert audio.content.startswith(b"RIFF")
            default = client.audio.speech.create(
                model="tts", input="Hello there.", voice="default", response_format="wav"
            )
            assert len(default.content) == len(audio.content)
            with pytest.raises(openai.BadRequestError) as err:
                client.audio.speech.create(model="tts", input="Hello there.", voice="nobody-here")
            assert "speaks with: " in str(err.value)
