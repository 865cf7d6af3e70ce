"""Text to video as a real process on loopback, driven by the official ``openai`` client's ``videos``
resource: ``omnimodel serve --preset text-to-video --model tiny://text-to-video``.

create → poll → download an MP4 that PyAV decodes to the requested frames and size; bad requests are 400s
naming the field and leave the other jobs alone; list and delete; a job that runs past its deadline is
``failed`` with its error, and the next job still completes.

The failing job: the server runs with a 5 s request budget (``OMNIMODEL_REQUEST_TIMEOUT``) and the job asks
for 200 steps of 256x256x81 (about a minute of this CPU's work), so its deadline passes mid-denoise and the
stage abandons it; the other jobs take a fraction of a second.
"""

from __future__ import annotations

import io
from pathlib import Path

import av
import openai
import pytest
from openai.types import Video
from runtime_procs import RuntimeProcess, free_port, openai_client, running, runtime_env, served_in_process

from omnimodel_runtime.serve import serve_pipeline
from omnimodel_testbed.procs import apoll, poll

pytestmark = [
    pytest.mark.engine,
    # openai 2.x warns that OpenAI's own (Sora) service shuts down; its videos resource is still the API
    # shape vLLM-Omni and this server answer.
    pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning"),
]

MODEL = "text-to-video"
BUDGET = 5.0


def finished(client: openai.OpenAI, video_id: str, timeout: float = 60.0) -> Video:
    """Poll the job until it is completed or failed (failing the test after ``timeout`` seconds)."""

    def ended() -> Video | None:
        video = client.videos.retrieve(video_id)
        return video if video.status in ("completed", "failed") else None

    return poll(ended, timeout=timeout, what=f"video {video_id} completed or failed", interval=0.05)


@pytest.mark.slow
def test_serve_answers_the_openai_videos_api(tmp_path: Path, model_cache: Path, tiny_t2v: Path) -> None:
    serve = RuntimeProcess(
        "serve",
        ["serve", "--preset", MODEL, "--model", f"tiny://{MODEL}"],
        log_dir=tmp_path,
        env=runtime_env(model_cache, OMP_NUM_THREADS=1, OMNIMODEL_REQUEST_TIMEOUT=BUDGET),
        port=free_port(),
    )
    with running(serve):
        serve.wait_healthy()
        client = openai_client(serve.url, timeout=60)
        created = client.videos.create(
            model=MODEL,
            prompt="a paper boat on a river",
            size="48x32",  # type: ignore[arg-type]  (any size the model makes, not only OpenAI's)
            extra_body={"num_frames": 9, "fps": 8, "num_inference_steps": 3, "seed": 4},
        )
        assert (created.status, created.size, created.seconds, created.model) == ("queued", "48x32", "1.12", MODEL)

        # Bad requests while the job runs: 400s naming the field, and the job is none the worse.
        for extra, param in (({"num_frames": 10}, "num_frames"), ({"size": "40x32"}, "size")):
            with pytest.raises(openai.BadRequestError) as err:
                client.videos.create(model=MODEL, prompt="x", extra_body=extra)
            assert err.value.body is not None
            assert err.value.body["param"] == param  # type: ignore[index]

        done = finished(client, created.id)
        assert (done.status, done.progress, done.error) == ("completed", 100, None)
        mp4 = client.videos.download_content(created.id).content
        with av.open(io.BytesIO(mp4)) as container:
            frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
        assert len(frames) == 9
        assert {f.shape for f in frames} == {(32, 48, 3)}

        assert [v.id for v in client.videos.list().data] == [created.id]

        # A job past its deadline fails with its error; the next job completes.
        slow = client.videos.create(
            model=MODEL,
            prompt="a storm over the ocean",
            size="256x256",  # type: ignore[arg-type]
            extra_body={"num_frames": 81, "num_inference_steps": 200, "seed": 1},
        )
        failed = finished(client, slow.id)
        assert failed.status == "failed"
        assert failed.error is not None
        assert failed.error.code == "504" and "deadline" in failed.error.message
        with pytest.raises(openai.ConflictError):
            client.videos.download_content(slow.id)
        after = client.videos.create(
            model=MODEL, prompt="a lighthouse", extra_body={"num_frames": 5, "size": "32x32", "num_inference_steps": 2}
        )
        assert finished(client, after.id).status == "completed"

        assert [v.id for v in client.videos.list().data] == [after.id, slow.id, created.id]
        deleted = client.videos.delete(created.id)
        assert deleted.deleted
        with pytest.raises(openai.NotFoundError):
            client.videos.retrieve(created.id)
        assert [v.id for v in client.videos.list().data] == [after.id, slow.id]


@pytest.mark.slow
async def test_a_video_of_the_default_size_is_made(model_cache: Path, tiny_t2v: Path) -> None:
    """A request without a size gets WanPipeline's default, 832x480 (in process, the same serve app). The
    tiny model made no video at it, nor at any of OpenAI's sizes (each a failed job, a 500), while its
    rotary embedding had positions for 32 patches a side: 832 pixels are 52."""
    async with served_in_process(serve_pipeline(MODEL, f"tiny://{MODEL}", device="cpu"), model_cache) as served:
        client = served.openai
        created = await client.videos.create(
            model=MODEL, prompt="a paper boat", extra_body={"num_frames": 5, "num_inference_steps": 2, "seed": 1}
        )
        assert created.size == "832x480"

        async def ended() -> Video | None:
            video = await client.videos.retrieve(created.id)
            return video if video.status in ("completed", "failed") else None

        done = await apoll(ended, timeout=120, what=f"video {created.id} completed or failed", interval=0.1)
        assert (done.status, done.error) == ("completed", None)
        mp4 = (await client.videos.download_content(created.id)).content
    with av.open(io.BytesIO(mp4)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == 5
    assert {f.shape for f in frames} == {(480, 832, 3)}


def test_the_shipped_keepalive_is_well_inside_the_shipped_stage_read_timeout() -> None:
    """The test below runs both scaled down (0.5 s keep-alives, a 2 s read timeout); what users get must
    keep the same margin, or a queued job would end in a 504 under the shipped settings."""
    from omnimodel_runtime.engines.t2v.diffusers import KEEPALIVE
    from omnimodel_runtime.settings import RuntimeSettings

    assert RuntimeSettings.model_fields["stage_read_timeout"].default >= KEEPALIVE * 4


@pytest.mark.slow
def test_a_job_queued_on_a_remote_stage_outlives_the_stage_read_timeout(
    tmp_path: Path, model_cache: Path, tiny_t2v: Path
) -> None:
    """``omnimodel stage`` behind ``omnimodel gateway``, the gateway's stage read timeout 2 s: a job that
    waits longer than that behind another one still completes, because the stage sends keep-alive frames
    (every 0.5 s here, ``engine_args.keepalive``) while it is queued."""
    port = free_port()
    pipeline = serve_pipeline(MODEL, f"tiny://{MODEL}", device="cpu")
    (stage,) = pipeline.stages
    stage = stage.model_copy(update={"endpoints": (f"http://127.0.0.1:{port}",), "engine_args": {"keepalive": 0.5}})
    path = tmp_path / "pipeline.json"
    path.write_text(pipeline.model_copy(update={"stages": (stage,)}).to_json())
    env = runtime_env(model_cache, OMP_NUM_THREADS=1, OMNIMODEL_HEALTH_INTERVAL=0.5, OMNIMODEL_STAGE_READ_TIMEOUT=2.0)
    proc = RuntimeProcess(
        "generate", ["stage", "--pipeline", str(path), "--stage", "generate"], log_dir=tmp_path, env=env, port=port
    )
    gateway = RuntimeProcess(
        "gateway", ["gateway", "--pipeline", str(path)], log_dir=tmp_path, env=env, port=free_port()
    )
    with running(proc, gateway):
        proc.wait_healthy()
        gateway.wait_healthy()
        client = openai_client(gateway.url, timeout=60)
        # About 6 s of this CPU's work (20 steps of 256x256x81), then the short job behind it.
        first = client.videos.create(
            model=MODEL,
            prompt="a storm",
            size="256x256",  # type: ignore[arg-type]
            extra_body={"num_frames": 81, "num_inference_steps": 20, "seed": 1},
        )
        second = client.videos.create(
            model=MODEL,
            prompt="a lighthouse",
            size="32x32",  # type: ignore[arg-type]
            extra_body={"num_frames": 9, "num_inference_steps": 2, "seed": 2},
        )
        with pytest.raises(openai.BadRequestError) as err:  # the stage's own check, across the hop
            client.videos.create(model=MODEL, prompt="x", extra_body={"num_frames": 6})
        assert err.value.body is not None
        assert err.value.body["param"] == "num_frames"  # type: ignore[index]
        done = finished(client, second.id)
        assert (done.status, done.error) == ("completed", None)
        assert finished(client, first.id).status == "completed"
        first_done = client.videos.retrieve(first.id).completed_at
        assert first_done is not None and done.completed_at is not None and done.completed_at >= first_done
        with av.open(io.BytesIO(client.videos.download_content(second.id).content)) as container:
            frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
        assert len(frames) == 9 and frames[0].shape == (32, 32, 3)
