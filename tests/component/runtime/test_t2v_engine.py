"""The text-to-video engine on the tiny Wan2.2-layout pipeline, in process: its frames are diffusers' own
``WanPipeline`` frames for the same seed, its MP4 decodes to the requested frames and size, what the model
cannot make is a 400 naming the field before any work, and a request whose caller leaves stops its
denoise loop.

The engine starts once per module; the reference is ``WanPipeline.from_pretrained`` on the same checkpoint,
called directly with a CPU generator of the same seed and ``output_type="pil"`` (diffusers' own
conversion to 8-bit pixels).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import av
import numpy as np
import pytest
import pytest_asyncio
import torch
from runtime_procs import torch_threads

from omnimodel_runtime.engines.base import EngineContext
from omnimodel_runtime.engines.registry import create_engine
from omnimodel_runtime.engines.t2v.diffusers import KEEPALIVE, DiffusersVideoEngine, VideoDefaults, resolve
from omnimodel_runtime.errors import StageError
from omnimodel_runtime.pipeline import ModelSource, get_preset
from omnimodel_runtime.protocol.stage import (
    FinalFrame,
    ResponseFrame,
    StageInput,
    StageParams,
    StageRequest,
    TensorFrame,
)
from omnimodel_runtime.protocol.videos import FRAMES_TENSOR, VIDEO_TENSOR, TextToVideoParams
from omnimodel_runtime.settings import RuntimeSettings

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="module")]

STEPS = 4
PROMPT = "a red fox running through the snow, camera pans"


@pytest.fixture(scope="module", autouse=True)
def few_threads() -> Iterator[None]:
    """Two intra-op threads at most: the box is shared, and tiny models gain nothing from more."""
    with torch_threads(min(2, os.cpu_count() or 1)):
        yield


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_t2v: Path) -> AsyncIterator[DiffusersVideoEngine]:
    (stage,) = get_preset("text-to-video").pipeline(ModelSource(source="tiny://text-to-video")).stages
    created = create_engine(EngineContext(stage=stage, model_dir=tiny_t2v, settings=RuntimeSettings(device="cpu")))
    assert isinstance(created, DiffusersVideoEngine)
    await created.start()
    await created.warmup()
    yield created
    await created.stop()


@pytest.fixture(scope="module")
def diffusers_pipe(tiny_t2v: Path) -> Any:
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(tiny_t2v)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def request(prompt: str = PROMPT, **params: Any) -> StageInput:
    video = TextToVideoParams(**{"num_inference_steps": STEPS, "width": 32, "height": 32, **params})
    return StageInput(
        request=StageRequest(request_id=f"r{time.monotonic_ns()}", prompt=prompt, params=StageParams(video=video))
    )


async def run(engine: DiffusersVideoEngine, inp: StageInput) -> list[ResponseFrame]:
    return [frame async for frame in engine.generate(inp)]


def tensor(frames: list[ResponseFrame], name: str) -> np.ndarray:
    (found,) = [f.tensors[name] for f in frames if isinstance(f, TensorFrame) and name in f.tensors]
    return np.asarray(found)


@pytest.mark.slow
async def test_frames_are_the_diffusers_pipelines_pixels(engine: DiffusersVideoEngine, diffusers_pipe: Any) -> None:
    kwargs: dict[str, Any] = {"negative_prompt": "blurry, static", "guidance_scale": 4.0, "guidance_scale_2": 2.0}
    frames = await run(engine, request(num_frames=9, width=48, height=32, seed=11, output="frames", **kwargs))
    got = tensor(frames, FRAMES_TENSOR)
    expected = diffusers_pipe(
        PROMPT,
        height=32,
        width=48,
        num_frames=9,
        num_inference_steps=STEPS,
        generator=torch.Generator("cpu").manual_seed(11),
        output_type="pil",
        **kwargs,
    ).frames[0]
    want = np.stack([np.asarray(frame) for frame in expected])
    assert got.shape == want.shape == (9, 32, 48, 3)
    assert got.dtype == np.uint8
    assert np.array_equal(got, want)
    # Both Wan2.2 experts ran: the schedule crosses the boundary between them.
    diffusers_pipe.scheduler.set_timesteps(STEPS)
    boundary = diffusers_pipe.config.boundary_ratio * diffusers_pipe.scheduler.config.num_train_timesteps
    steps = diffusers_pipe.scheduler.timesteps
    assert (steps >= boundary).any() and (steps < boundary).any()
    # Another seed is another video; the same seed the same one.
    other = tensor(
        await run(engine, request(num_frames=9, width=48, height=32, seed=12, output="frames", **kwargs)), FRAMES_TENSOR
    )
    assert not np.array_equal(other, got)
    again = tensor(
        await run(engine, request(num_frames=9, width=48, height=32, seed=11, output="frames", **kwargs)), FRAMES_TENSOR
    )
    assert np.array_equal(again, got)


@pytest.mark.slow
async def test_the_mp4_decodes_to_the_requested_frames_and_size(engine: DiffusersVideoEngine) -> None:
    frames = await run(engine, request(num_frames=13, width=64, height=32, fps=8, seed=3))
    accepted, progress = (
        frames[0],
        [f.meta["progress"] for f in frames if isinstance(f, TensorFrame) and "progress" in f.meta],
    )
    assert isinstance(accepted, TensorFrame)
    assert accepted.meta["accepted"] == {"width": 64, "height": 32, "num_frames": 13, "fps": 8}
    assert progress == sorted(progress) and progress[0] == 0 and len(progress) == STEPS + 1
    assert isinstance(frames[-1], FinalFrame)
    data = tensor(frames, VIDEO_TENSOR).tobytes()
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        decoded = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
        assert stream.average_rate == 8
    assert len(decoded) == 13
    assert {d.shape for d in decoded} == {(32, 64, 3)}
    raw = tensor(
        await run(engine, request(num_frames=13, width=64, height=32, fps=8, seed=3, output="frames")), FRAMES_TENSOR
    )
    # H.264 is lossy, but the file holds these frames, not others.
    assert np.abs(np.stack(decoded).astype(int) - raw.astype(int)).mean() < 8


@pytest.mark.slow
async def test_seconds_become_the_nearest_frame_count_of_the_models_form(engine: DiffusersVideoEngine) -> None:
    frames = await run(engine, request(seconds=1.0, fps=8, seed=1, num_inference_steps=2))
    first = frames[0]
    assert isinstance(first, TensorFrame)
    assert first.meta["accepted"]["num_frames"] == 9  # 8 frames a second, rounded to 4k+1


@pytest.mark.slow
@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"num_frames": 10}, "num_frames"),
        ({"width": 40, "height": 32}, "size"),
    ],
)
async def test_what_the_model_cannot_make_is_a_400_before_any_work(
    engine: DiffusersVideoEngine, params: dict[str, Any], param: str
) -> None:
    stream = engine.generate(request(**params))
    with pytest.raises(StageError) as err:
        await anext(stream)
    assert (err.value.status, err.value.param) == (400, param)
    with pytest.raises(StageError) as err:
        await anext(engine.generate(request("  ")))
    assert (err.value.status, err.value.param) == (400, "prompt")
    assert engine.queue_depth() == 0


@pytest.mark.parametrize(
    ("params", "param"),
    [
        (TextToVideoParams(width=528, height=32), "size"),
        (TextToVideoParams(width=32, height=528), "size"),
        (TextToVideoParams(num_frames=129), "num_frames"),
        (TextToVideoParams(seconds=8.0), "seconds"),
    ],
)
async def test_a_video_beyond_the_rotary_embeddings_positions_is_a_400(params: TextToVideoParams, param: str) -> None:
    # A checkpoint whose rotary embedding covers 32 positions an axis (diffusers' test transformer): 32
    # patches of 16 pixels a side, 32 latent frames of 4.
    small = VideoDefaults(
        width=32,
        height=32,
        num_frames=81,
        steps=2,
        guidance_scale=5.0,
        fps=16,
        multiple=16,
        temporal=4,
        max_side=512,
        max_frames=125,
        two_experts=False,
    )
    with pytest.raises(StageError) as err:
        resolve(params, small)
    assert (err.value.status, err.value.param) == (400, param)
    resolve(TextToVideoParams(width=512, height=512, num_frames=125), small)


@pytest.mark.slow
async def test_the_loaded_model_states_what_its_rotary_embedding_covers(engine: DiffusersVideoEngine) -> None:
    # Wan2.2's rope_max_seq_len, 1024 positions an axis: OpenAI's largest size, 1792 pixels, is 112 patches.
    assert (engine.defaults.max_side, engine.defaults.max_frames) == (1024 * 16, (1024 - 1) * 4 + 1)


@pytest.mark.slow
async def test_a_caller_that_leaves_stops_the_denoise_loop(engine: DiffusersVideoEngine) -> None:
    calls: list[int] = []
    hooks = [
        module.register_forward_hook(lambda *_: calls.append(1))
        for module in (engine._pipe.transformer, engine._pipe.transformer_2)
    ]
    try:
        steps = 200
        stream = engine.generate(request(num_frames=5, num_inference_steps=steps, seed=2))
        async with contextlib.aclosing(stream):
            async for frame in stream:
                if isinstance(frame, TensorFrame) and frame.meta.get("progress", 0) > 0:
                    break  # the caller goes away after the first step
        # The engine is free again: the next request runs and finishes.
        done = await asyncio.wait_for(run(engine, request(num_frames=5, num_inference_steps=2, seed=3)), 120)
        assert isinstance(done[-1], FinalFrame)
    finally:
        for hook in hooks:
            hook.remove()
    # Two transformer calls a step (guidance on): the 200-step request stopped within a few steps.
    assert len(calls) < 2 * 10 + 2 * 2


@pytest.mark.slow
async def test_a_queued_request_gets_keepalive_frames_until_it_runs(engine: DiffusersVideoEngine) -> None:
    """A gateway reading a remote stage must hear from a job waiting behind another one."""
    engine.keepalive = 0.05
    try:
        long = engine.generate(request(num_frames=5, num_inference_steps=200, seed=2))
        waiting = engine.generate(request(num_frames=5, num_inference_steps=2, seed=3))
        async with contextlib.aclosing(long), contextlib.aclosing(waiting):
            async for frame in long:
                if isinstance(frame, TensorFrame) and frame.meta.get("progress", 0) > 0:
                    break  # the long one runs on the worker
            kinds = []
            async for frame in waiting:
                assert isinstance(frame, TensorFrame)
                kinds.append(next(iter(frame.meta)))
                if kinds.count("keepalive") == 3:
                    break
            assert kinds[0] == "accepted" and "progress" not in kinds  # still queued behind the long one
    finally:
        engine.keepalive = KEEPALIVE
