"""A lone UTF-16 surrogate in a request (``"a\\ud800b"``: JSON may escape one, Python's JSON parser keeps it,
no tokenizer takes it) on every route whose text reaches a tokenizer, on each preset's real tiny model in
process: a 400 in OpenAI's envelope naming the field, while a good request sent beside it is answered.

Before the protocol checked text, the tokenizers raised a TypeError ("TextEncodeInput must be Union[...]")
and each of these was a 500 (for videos: the accepted job's answer, which echoes the prompt, could not be
encoded).
"""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from runtime_procs import random_png, served_in_process

from omnimodel_runtime.serve import serve_pipeline

pytestmark = [
    pytest.mark.engine,
    # openai 2.x warns that OpenAI's own (Sora) service shuts down.
    pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning"),
]

BAD = "a\ud800b"


def chat(text: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 2}


def edit_chat(text: str) -> dict[str, Any]:
    image = "data:image/png;base64," + base64.b64encode(random_png(32, 32, seed=1)).decode()
    content = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": image}}]
    return {"messages": [{"role": "user", "content": content}], "num_inference_steps": 2, "seed": 1}


IMAGE = {"size": "32x32", "num_inference_steps": 2, "seed": 1}
VIDEO = {"size": "48x32", "num_frames": 5, "num_inference_steps": 2, "seed": 1}

# preset -> (route, body of the text, the field a surrogate in it is named as)
ROUTES: dict[str, list[tuple[str, Any, str]]] = {
    "text": [
        ("/v1/chat/completions", chat, "messages.0.content"),
        ("/v1/completions", lambda text: {"prompt": text, "max_tokens": 2}, "prompt"),
    ],
    "qwen2.5-omni": [("/v1/chat/completions", chat, "messages.0.content")],
    "qwen3-omni": [("/v1/chat/completions", chat, "messages.0.content")],
    "text-to-image": [
        ("/v1/images/generations", lambda text: {"prompt": text, **IMAGE}, "prompt"),
        ("/v1/chat/completions", lambda text: {**chat(text), **IMAGE}, "messages.0.content"),
    ],
    "qwen-image-edit": [("/v1/chat/completions", edit_chat, "messages.0.content")],
    "text-to-video": [("/v1/videos", lambda text: {"prompt": text, **VIDEO}, "prompt")],
}


# The session fixture (conftest.py) that builds each preset's tiny model.
TINY = {
    "text": "tiny_text",
    "qwen2.5-omni": "tiny_omni",
    "qwen3-omni": "tiny_qwen3",
    "text-to-image": "tiny_t2i",
    "qwen-image-edit": "tiny_edit",
    "text-to-video": "tiny_t2v",
}


async def post(http: httpx.AsyncClient, route: str, preset: str, body: dict[str, Any]) -> httpx.Response:
    # json.dumps escapes the surrogate as the six characters \ud800, as a client's JSON encoder would.
    content = json.dumps({"model": preset, **body}).encode()
    return await http.post(route, content=content, headers={"content-type": "application/json"})


async def video_done(http: httpx.AsyncClient, video_id: str) -> dict[str, Any]:
    for _ in range(600):
        job: dict[str, Any] = (await http.get(f"/v1/videos/{video_id}")).json()
        if job["status"] in ("completed", "failed"):
            return job
        await asyncio.sleep(0.1)
    raise AssertionError(f"video {video_id} did not finish")


# Over 5 s each on two cores (docs/development.md): these two presets' servers load the omni and edit models.
SLOW_PRESETS = ("qwen2.5-omni", "qwen-image-edit")


@pytest.mark.parametrize(
    "preset", [pytest.param(p, marks=pytest.mark.slow) if p in SLOW_PRESETS else p for p in ROUTES]
)
async def test_a_lone_surrogate_is_a_400_naming_the_field_and_the_request_beside_it_is_answered(
    request: pytest.FixtureRequest, model_cache: Path, preset: str
) -> None:
    request.getfixturevalue(TINY[preset])
    pipeline = serve_pipeline(preset, f"tiny://{preset}", device="cpu", local_defaults=True)
    async with served_in_process(pipeline, model_cache) as served:
        for route, body, param in ROUTES[preset]:
            bad, good = await asyncio.gather(
                post(served.http, route, preset, body(BAD)), post(served.http, route, preset, body("a boat"))
            )
            assert bad.status_code == 400, (route, bad.text)
            error = bad.json()["error"]
            assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, 400)
            assert "lone UTF-16 surrogate (U+D800 at character 1)" in error["message"]
            assert good.status_code == 200, (route, good.text)
            if route == "/v1/videos":
                assert (await video_done(served.http, good.json()["id"]))["status"] == "completed"
