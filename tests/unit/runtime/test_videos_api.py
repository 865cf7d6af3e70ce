"""``/v1/videos`` on the text-to-video preset, against a fake stage engine, through the official ``openai``
client's ``videos`` resource (its create sends a multipart form) and plain JSON.

The fake has the real engine's frame protocol: an ``accepted`` frame after its checks (a frame count not
of the form 4k+1 is a 400 naming ``num_frames``), progress frames, then the MP4 bytes. A prompt of "fail"
fails after being accepted; jobs wait on ``gate`` so tests can look at them queued and in progress.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from prometheus_client import CollectorRegistry
from runtime_fakes import asgi_client, fake_context, lifespan, openai_client

from omnimodel_runtime.engines.base import Engine
from omnimodel_runtime.errors import StageError
from omnimodel_runtime.gateway import build_app
from omnimodel_runtime.metrics import StageMetricsFamily
from omnimodel_runtime.pipeline import ModelSource, Pipeline, get_preset
from omnimodel_runtime.protocol.stage import FinalFrame, ResponseFrame, StageInput, TensorFrame
from omnimodel_runtime.protocol.videos import VIDEO_TENSOR, TextToVideoParams
from omnimodel_runtime.settings import RuntimeSettings
from omnimodel_runtime.stage.handle import StageHandle
from omnimodel_runtime.stage.local import LocalStage
from omnimodel_testbed.procs import apoll

# openai 2.x warns that OpenAI's own (Sora) video service shuts down; the client's videos resource is still
# the shape vLLM-Omni and this server answer.
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")

MODEL = "text-to-video"
DEADLINE = 10.0


class FakeVideoStage(Engine):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = asyncio.Event()
        self.requests: list[StageInput] = []
        self.closed: list[str] = []

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def generate(self, inp: StageInput) -> AsyncIterator[ResponseFrame]:
        params = inp.request.params.video or TextToVideoParams()
        frames = params.num_frames or 81
        if frames % 4 != 1:
            raise StageError("num_frames: this model makes 4k+1 frames", status=400, param="num_frames")
        self.requests.append(inp)
        accepted = {
            "width": params.width or 832,
            "height": params.height or 480,
            "num_frames": frames,
            "fps": params.fps or 16,
        }
        try:
            yield TensorFrame({}, meta={"accepted": accepted})
            yield TensorFrame({}, meta={"progress": 0})
            await self.gate.wait()
            if inp.request.prompt == "fail":
                raise StageError("stage 'generate' failed: out of memory", status=500)
            yield TensorFrame({}, meta={"progress": 50})
            payload = np.frombuffer(f"MP4 of {inp.request.prompt}".encode(), dtype=np.uint8)
            yield TensorFrame({VIDEO_TENSOR: payload}, meta={"modality": "video", **accepted})
            yield FinalFrame("stop")
        finally:
            self.closed.append(inp.request.request_id)


class VideoServe:
    def __init__(self) -> None:
        self.pipeline: Pipeline = get_preset(MODEL).pipeline(ModelSource(source=f"tiny://{MODEL}"))
        (stage,) = self.pipeline.stages
        registry = CollectorRegistry()
        metrics = StageMetricsFamily(registry).for_stage(stage.name)
        self.engine = FakeVideoStage(fake_context(stage, metrics))
        handles: dict[str, StageHandle] = {stage.name: LocalStage(stage, self.engine, metrics)}
        self.app = build_app(RuntimeSettings(), self.pipeline, handles, registry=registry)


@pytest.fixture
async def serve() -> AsyncIterator[VideoServe]:
    s = VideoServe()
    async with lifespan(s.app):
        yield s


@pytest.fixture
async def http(serve: VideoServe) -> AsyncIterator[httpx.AsyncClient]:
    async with asgi_client(serve.app) as client:
        yield client


@pytest.fixture
def client(http: httpx.AsyncClient) -> openai.AsyncOpenAI:
    return openai_client(http)


async def status(client: openai.AsyncOpenAI, video_id: str, wanted: str) -> bool:
    return (await client.videos.retrieve(video_id)).status == wanted


async def test_create_poll_download_list_delete(client: openai.AsyncOpenAI, serve: VideoServe) -> None:
    video = await client.videos.create(
        model=MODEL,
        prompt="a fox running",
        size="64x32",  # type: ignore[arg-type]  (any size the model makes, not only OpenAI's)
        extra_body={"num_frames": 9, "fps": 8, "num_inference_steps": 3, "seed": 5, "negative_prompt": "blur"},
    )
    assert (video.object, video.status, video.model, video.size, video.progress) == (
        "video",
        "queued",
        MODEL,
        "64x32",
        0,
    )
    assert video.seconds == "1.12"  # 9 frames at 8 fps
    (inp,) = serve.engine.requests
    assert inp.request.params.video == TextToVideoParams(
        width=64, height=32, num_frames=9, fps=8, num_inference_steps=3, seed=5, negative_prompt="blur"
    )
    await apoll(lambda: status(client, video.id, "in_progress"), timeout=DEADLINE, what="in_progress")
    with pytest.raises(openai.ConflictError) as err:
        await client.videos.download_content(video.id)
    assert err.value.code == "video_not_ready"
    serve.engine.gate.set()
    await apoll(lambda: status(client, video.id, "completed"), timeout=DEADLINE, what="completed")
    done = await client.videos.retrieve(video.id)
    assert done.progress == 100 and done.completed_at is not None and done.error is None
    content = await client.videos.download_content(video.id)
    assert content.content == b"MP4 of a fox running"
    assert content.response.headers["content-type"] == "video/mp4"
    listed = await client.videos.list()
    assert [v.id for v in listed.data] == [video.id]
    deleted = await client.videos.delete(video.id)
    assert (deleted.id, deleted.deleted, deleted.object) == (video.id, True, "video.deleted")
    with pytest.raises(openai.NotFoundError):
        await client.videos.retrieve(video.id)
    assert (await client.videos.list()).data == []


async def test_vllm_omnis_form_fields(http: httpx.AsyncClient, serve: VideoServe) -> None:
    """vLLM-Omni's example client: a form with width, height, num_frames, fps, guidance_scale_2."""
    form = {"prompt": "cats boxing", "width": "832", "height": "480", "num_frames": "33", "fps": "16"}
    form |= {"num_inference_steps": "40", "guidance_scale": "4.0", "guidance_scale_2": "4.0", "seed": "42"}
    answer = await http.post("/v1/videos", data=form)
    assert answer.status_code == 200, answer.text
    assert (answer.json()["size"], answer.json()["seconds"]) == ("832x480", "2.06")
    (inp,) = serve.engine.requests
    assert inp.request.params.video == TextToVideoParams(
        width=832,
        height=480,
        num_frames=33,
        fps=16,
        num_inference_steps=40,
        guidance_scale=4.0,
        guidance_scale_2=4.0,
        seed=42,
    )


async def test_json_body_and_seconds(http: httpx.AsyncClient, serve: VideoServe) -> None:
    answer = await http.post("/v1/videos", json={"prompt": "waves", "seconds": "4", "size": "832x480"})
    assert answer.status_code == 200, answer.text
    assert answer.json()["status"] == "queued"
    (inp,) = serve.engine.requests
    assert inp.request.params.video == TextToVideoParams(width=832, height=480, seconds=4.0)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "size": "64"}, "size"),
        ({"prompt": "x", "size": "9000x64"}, "size"),
        ({"prompt": "x", "num_frames": 10}, "num_frames"),  # the stage's 4k+1 rule, still a 400
        ({"prompt": "x", "num_frames": 9, "seconds": 1}, "num_frames"),
        ({"prompt": "x", "seconds": 0}, "seconds"),
        ({"prompt": "x", "fps": 0}, "fps"),
        ({"prompt": "x", "num_inference_steps": "many"}, "num_inference_steps"),
        ({"prompt": "  "}, "prompt"),
        ({"size": "64x64"}, "prompt"),
        ({"prompt": "x", "width": 64}, "height"),
        ({"prompt": "x", "width": 64, "height": 32, "size": "32x32"}, "height"),
        ({"prompt": "x", "n": 2}, "n"),
        ({"prompt": "x", "flow_shift": 5.0}, "flow_shift"),
        ({"prompt": "x", "boundary_ratio": 0.9}, "boundary_ratio"),
    ],
)
async def test_bad_requests_are_400s_naming_the_field(
    http: httpx.AsyncClient, serve: VideoServe, body: dict[str, Any], param: str
) -> None:
    for answer in (await http.post("/v1/videos", json=body), await http.post("/v1/videos", data=body)):
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == param
    assert serve.engine.requests == []
    assert (await http.get("/v1/videos")).json()["data"] == []


async def test_unknown_ids_and_models(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> None:
    for call in (
        client.videos.retrieve("video-nope"),
        client.videos.download_content("video-nope"),
        client.videos.delete("video-nope"),
    ):
        with pytest.raises(openai.NotFoundError) as err:
            await call
        assert err.value.code == "video_not_found"
    with pytest.raises(openai.NotFoundError) as err:
        await client.videos.create(model="sora-2", prompt="x")
    assert err.value.code == "model_not_found"
    answer = await http.post("/v1/videos", files={"input_reference": ("a.png", b"x")}, data={"prompt": "x"})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "input_reference"


async def test_a_failed_job_is_failed_with_its_error_and_others_complete(
    client: openai.AsyncOpenAI, serve: VideoServe
) -> None:
    bad = await client.videos.create(model=MODEL, prompt="fail", extra_body={"num_frames": 5})
    good = await client.videos.create(model=MODEL, prompt="ok", extra_body={"num_frames": 5})
    serve.engine.gate.set()
    await apoll(lambda: status(client, bad.id, "failed"), timeout=DEADLINE, what="the bad job failed")
    await apoll(lambda: status(client, good.id, "completed"), timeout=DEADLINE, what="the good job completed")
    failed = await client.videos.retrieve(bad.id)
    assert failed.error is not None
    assert failed.error.code == "500" and "out of memory" in failed.error.message
    with pytest.raises(openai.ConflictError):
        await client.videos.download_content(bad.id)
    assert (await client.videos.download_content(good.id)).content == b"MP4 of ok"


async def test_deleting_a_running_job_cancels_it(client: openai.AsyncOpenAI, serve: VideoServe) -> None:
    video = await client.videos.create(model=MODEL, prompt="long", extra_body={"num_frames": 5})
    await apoll(lambda: status(client, video.id, "in_progress"), timeout=DEADLINE, what="in_progress")
    assert serve.engine.closed == []
    await client.videos.delete(video.id)
    assert serve.engine.closed == [video.id]  # the stage's stream was closed: its work stops


async def test_the_job_store_is_bounded(http: httpx.AsyncClient, serve: VideoServe) -> None:
    serve.app.state.api.videos.max_jobs = 2
    first = (await http.post("/v1/videos", json={"prompt": "a", "num_frames": 5})).json()
    (await http.post("/v1/videos", json={"prompt": "b", "num_frames": 5})).json()
    refused = await http.post("/v1/videos", json={"prompt": "c", "num_frames": 5})
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "too_many_jobs"
    serve.engine.gate.set()

    async def finished() -> bool:
        data = (await http.get("/v1/videos")).json()["data"]
        return all(v["status"] == "completed" for v in data)

    await apoll(finished, timeout=DEADLINE, what="finished")
    third = await http.post("/v1/videos", json={"prompt": "c", "num_frames": 5})
    assert third.status_code == 200
    ids = [v["id"] for v in (await http.get("/v1/videos", params={"order": "asc"})).json()["data"]]
    assert first["id"] not in ids and third.json()["id"] in ids and len(ids) == 2  # the oldest finished went
