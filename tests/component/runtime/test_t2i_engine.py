"""The diffusers engine on the tiny Qwen-Image pipeline, in process: split equals whole equals diffusers,
request batching in denoise, and what each stage loads.

Engines start once per module (three split stages and one whole-pipeline stage); the reference is
diffusers' own ``QwenImagePipeline`` called directly on the same checkpoint with the same seeds.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
import torch
from pydantic import ValidationError
from runtime_procs import torch_threads
from stage_engines import (
    Deployed,
    assert_rounding_only,
    conv3d_calls,
    diffusers_images,
    diffusers_pipeline,
    images_of,
    stages_in_process,
)

from omnimodel_runtime.engines.base import EngineContext
from omnimodel_runtime.engines.registry import create_engine
from omnimodel_runtime.engines.t2i.diffusers import DiffusersImageEngine
from omnimodel_runtime.engines.t2i.fused import MODULATIONS
from omnimodel_runtime.engines.t2i.guidance import BatchedGuidance
from omnimodel_runtime.engines.t2i.qwen_image import QwenImageFamily
from omnimodel_runtime.engines.t2i.wire import from_wire, to_wire
from omnimodel_runtime.errors import StageError
from omnimodel_runtime.pipeline import EngineName, Modality, ModelSource, Pipeline, Route, Stage, StageKind, get_preset
from omnimodel_runtime.protocol.images import TextToImageParams
from omnimodel_runtime.protocol.stage import (
    FinalFrame,
    ResponseFrame,
    StageInput,
    StageParams,
    StageRequest,
    TensorFrame,
)
from omnimodel_runtime.settings import RuntimeSettings
from omnimodel_testbed.procs import apoll

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="module")]

STEPS = 3
# Prompts of different token lengths: batching them pads and masks the shorter ones.
PROMPTS = ["a red cat", "a blue dog beside a small wooden house under the moon", "sun", "green car on the beach"]


class RecordingMetrics:
    def __init__(self) -> None:
        self.batches: list[int] = []

    def observe_batch(self, size: int) -> None:
        self.batches.append(size)

    def add_generated_tokens(self, count: int) -> None:
        pass


def whole_pipeline(model: str) -> Pipeline:
    """The pipeline as one stage: a custom graph (no preset), as an OmniModel listing its stages gives."""
    stage = Stage(
        name="t2i",
        kind=StageKind.DIFFUSION,
        engine=EngineName.DIFFUSERS,
        task="text-to-image",
        outputs=(Modality.IMAGE,),
    )
    return Pipeline(
        name="t2i-whole",
        model=ModelSource(source=model),
        stages=(stage,),
        modalities=(Modality.IMAGE,),
        routes=(Route.IMAGES, Route.CHAT),
    )


@pytest.fixture(scope="module", autouse=True)
def two_threads() -> Iterator[None]:
    """Two intra-op threads at most: the box is shared, and tiny models gain nothing from more."""
    with torch_threads(min(2, os.cpu_count() or 1)):
        yield


def deploy(pipeline: Pipeline, model_dir: Path, **engine_args: Any) -> contextlib.AbstractAsyncContextManager[Deployed]:
    """``pipeline``'s diffusers engines in process, each recording its batches."""
    return stages_in_process(
        pipeline, model_dir, engine_class=DiffusersImageEngine, metrics=RecordingMetrics, **engine_args
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def split(tiny_t2i: Path) -> AsyncIterator[Deployed]:
    # A long wait bound: requests of these tests are announced together, and a batch must not start
    # before the last of them has been encoded on a slow shared CPU.
    preset = get_preset("text-to-image").pipeline(ModelSource(source="tiny://x"))
    async with deploy(preset, tiny_t2i, batch_wait=5.0) as deployed:
        yield deployed


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def whole(tiny_t2i: Path) -> AsyncIterator[Deployed]:
    async with deploy(whole_pipeline("tiny://x"), tiny_t2i) as deployed:
        yield deployed


@pytest.fixture(scope="module")
def diffusers_pipe(tiny_t2i: Path) -> Any:
    return diffusers_pipeline("QwenImagePipeline", tiny_t2i)


def direct(
    pipe: Any, prompt: str, *, seed: int, n: int = 1, width: int = 32, height: int = 32, **kw: Any
) -> np.ndarray:
    """diffusers itself, 32x32 unless said otherwise."""
    return diffusers_images(pipe, prompt, seed=seed, steps=STEPS, n=n, width=width, height=height, **kw)


async def generate(deployed: Deployed, prompt: str, **params: Any) -> np.ndarray:
    request = StageRequest(
        request_id=f"r{time.monotonic_ns()}",
        prompt=prompt,
        params=StageParams(
            image=TextToImageParams(**{"num_inference_steps": STEPS, "width": 32, "height": 32, **params})
        ),
    )
    return await images_of(deployed, request)


@pytest.mark.slow
@pytest.mark.parametrize(
    "params",
    [
        {"seed": 11},
        {"seed": 12, "n": 2, "width": 48, "height": 32, "negative_prompt": "blurry, ugly", "true_cfg_scale": 3.0},
    ],
    ids=["plain", "n2-cfg-48x32"],
)
async def test_split_and_whole_give_the_diffusers_pipelines_pixels(
    split: Deployed, whole: Deployed, diffusers_pipe: Any, params: dict[str, Any]
) -> None:
    prompt = "a shiny robot holding a sign that says hello world"
    n = params.get("n", 1)
    extra = {k: params[k] for k in ("negative_prompt", "true_cfg_scale") if k in params}
    expected = direct(
        diffusers_pipe,
        prompt,
        seed=params["seed"],
        n=n,
        width=params.get("width", 32),
        height=params.get("height", 32),
        **extra,
    )
    assert expected.shape == (n, params.get("height", 32), params.get("width", 32), 3)
    assert len(np.unique(expected)) > 50  # a real picture of noise, not a flat field that any bug would match
    assert np.array_equal(await generate(split, prompt, **params), expected)
    assert np.array_equal(await generate(whole, prompt, **params), expected)


@pytest.mark.slow
async def test_bfloat16_stages_hand_off_exactly(tiny_t2i: Path) -> None:
    """bfloat16 (what accelerators run) has no numpy dtype: embeddings and latents cross between stages as
    raw bits, so the split still gives diffusers' bf16 pixels."""
    pipe = diffusers_pipeline("QwenImagePipeline", tiny_t2i, dtype=torch.bfloat16)
    params = {"seed": 3, "n": 2, "negative_prompt": "low quality", "true_cfg_scale": 2.0}
    expected = direct(pipe, "a dragon over a city", seed=3, n=2, negative_prompt="low quality", true_cfg_scale=2.0)
    pipeline = get_preset("text-to-image").pipeline(ModelSource(source="tiny://x"))
    async with deploy(pipeline, tiny_t2i, dtype="bfloat16") as deployed:
        assert np.array_equal(await generate(deployed, "a dragon over a city", **params), expected)


@pytest.mark.slow
async def test_the_seed_decides_the_image_and_the_prompt_changes_it(split: Deployed) -> None:
    a = await generate(split, "a red cat", seed=5)
    assert np.array_equal(a, await generate(split, "a red cat", seed=5))
    assert not np.array_equal(a, await generate(split, "a red cat", seed=6))
    assert not np.array_equal(a, await generate(split, "a green car", seed=5))


@pytest.mark.slow
async def test_concurrent_compatible_requests_denoise_as_one_batch_with_their_own_results(split: Deployed) -> None:
    alone = [await generate(split, p, seed=100 + i) for i, p in enumerate(PROMPTS)]
    metrics = split.metrics["denoise"]
    metrics.batches.clear()
    together = await asyncio.gather(*(generate(split, p, seed=100 + i) for i, p in enumerate(PROMPTS)))
    assert metrics.batches == [len(PROMPTS)]
    for one, batched in zip(alone, together, strict=True):
        assert_rounding_only(one, batched)


@pytest.mark.slow
async def test_requests_of_different_sizes_are_not_batched_together(split: Deployed) -> None:
    metrics = split.metrics["denoise"]
    metrics.batches.clear()
    sizes = [(32, 32), (48, 32), (32, 32), (48, 32)]
    results = await asyncio.gather(*(generate(split, "a fox", seed=1, width=w, height=h) for w, h in sizes))
    assert [r.shape[1:3] for r in results] == [(h, w) for w, h in sizes]
    assert sorted(metrics.batches) == [2, 2]


@pytest.mark.slow
async def test_a_batch_waits_only_a_bounded_time_for_requests_still_on_their_way(tiny_t2i: Path) -> None:
    stage = get_preset("text-to-image").pipeline(ModelSource(source="tiny://x")).stage("denoise")
    stage = stage.model_copy(update={"engine_args": {"batch_wait": 0.5}})
    metrics = RecordingMetrics()
    engine = create_engine(
        EngineContext(stage=stage, model_dir=tiny_t2i, settings=RuntimeSettings(device="cpu"), metrics=metrics)
    )
    await engine.start()
    try:
        assert isinstance(engine, DiffusersImageEngine)
        embeds, dtypes = await asyncio.to_thread(lambda: to_wire({"prompt_embeds": torch.ones((1, 5, 16))}))
        released = asyncio.Event()

        async def upstream(gate: asyncio.Event | None) -> AsyncIterator[ResponseFrame]:
            if gate is not None:
                await gate.wait()
            yield TensorFrame(embeds, meta={"dtypes": dtypes})
            yield FinalFrame("stop")

        async def run(gate: asyncio.Event | None) -> list[ResponseFrame]:
            request = StageRequest(
                request_id=f"r{time.monotonic_ns()}",
                params=StageParams(image=TextToImageParams(width=32, height=32, num_inference_steps=2)),
            )
            return [f async for f in engine.generate(StageInput(request=request, upstream=upstream(gate)))]

        held = asyncio.create_task(run(released))  # announced, but its embeddings never come
        ready = await asyncio.wait_for(run(None), timeout=60)
        assert isinstance(ready[-1], FinalFrame)
        assert not held.done()
        released.set()
        late = await asyncio.wait_for(held, timeout=60)
        assert isinstance(late[-1], FinalFrame)
        assert metrics.batches == [1, 1]
    finally:
        await engine.stop()


@pytest.mark.slow
async def test_a_request_that_goes_away_leaves_the_others_of_its_batch_intact(split: Deployed) -> None:
    alone = [await generate(split, p, seed=200 + i) for i, p in enumerate(PROMPTS[:3])]
    tasks = [asyncio.create_task(generate(split, p, seed=200 + i)) for i, p in enumerate(PROMPTS[:3])]
    denoise = split.engines["denoise"]
    # Every chain has started (its denoise request is announced or queued) before one of them leaves.
    await apoll(
        lambda: denoise.announced + denoise.queue_depth() >= 3 or any(t.done() for t in tasks),
        timeout=30, what="the three requests at the denoise stage", interval=0.005,
    )  # fmt: skip
    tasks[1].cancel()
    first, second, third = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(second, asyncio.CancelledError)
    for one, got in ((alone[0], first), (alone[2], third)):
        assert isinstance(got, np.ndarray)
        assert np.abs(one.astype(int) - got.astype(int)).max() <= 1
    # The engine is still serving.
    assert np.array_equal(await generate(split, PROMPTS[0], seed=200), alone[0])


@pytest.mark.slow
async def test_each_stage_loads_only_its_components(split: Deployed, whole: Deployed) -> None:
    assert split.engines["encode"].components == ("text_encoder", "tokenizer")
    assert split.engines["denoise"].components == ("scheduler", "transformer")
    assert split.engines["decode"].components == ("vae",)
    assert whole.engines["t2i"].components == ("scheduler", "text_encoder", "tokenizer", "transformer", "vae")


@pytest.mark.slow
async def test_a_stage_refuses_a_size_its_model_cannot_draw_with_a_400(split: Deployed) -> None:
    with pytest.raises(StageError) as err:
        await generate(split, "a cat", width=30, height=30)
    assert err.value.status == 400
    assert err.value.param == "size"


@pytest.mark.slow
async def test_one_step_is_a_400_naming_the_field_on_a_scheduler_with_a_terminal_shift(
    split: Deployed, whole: Deployed
) -> None:
    # Qwen-Image's schedule divides by zero at one step: diffusers would return an all-black image.
    for deployed in (split, whole):
        with pytest.raises(StageError) as err:
            await generate(deployed, "a cat", num_inference_steps=1)
        assert (err.value.status, err.value.param) == (400, "num_inference_steps")
        assert "at least 2" in err.value.message
    image = await generate(split, "a cat", num_inference_steps=2, seed=1)
    assert image.any()  # two steps draw something


@pytest.mark.parametrize(
    ("params", "loc"),
    [
        ({"width": 32, "height": None}, ()),
        ({"n": 0}, ("n",)),
        ({"seed": -5}, ("seed",)),
    ],
)
async def test_parameters_out_of_bounds_never_become_a_stage_request(
    params: dict[str, Any], loc: tuple[str, ...]
) -> None:
    # The typed stage parameters refuse them, naming the field; a stage server refuses such a request
    # body with a 400 (tests/unit/runtime/test_runtime_remote.py).
    with pytest.raises(ValidationError) as err:
        StageParams.model_validate({"image": params})
    assert err.value.errors()[0]["loc"] == ("image", *loc)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cfg_batched(tiny_t2i: Path) -> AsyncIterator[Deployed]:
    """The split preset with ``cfg_batch`` on (encode encodes both prompts in one pass, denoise runs both
    branches in one call)."""
    preset = get_preset("text-to-image").pipeline(ModelSource(source="tiny://x"))
    async with deploy(preset, tiny_t2i, batch_wait=5.0, cfg_batch=True) as deployed:
        yield deployed


@contextlib.contextmanager
def block_batches(engine: DiffusersImageEngine) -> Iterator[list[int]]:
    """The batch size of every call of the transformer's first block while the context is open."""
    sizes: list[int] = []
    block = engine._pipe.transformer.transformer_blocks[0]

    def record(_module: Any, _args: Any, kwargs: dict[str, Any]) -> None:
        sizes.append(kwargs["hidden_states"].shape[0])

    handle = block.register_forward_pre_hook(record, with_kwargs=True)
    try:
        yield sizes
    finally:
        handle.remove()


CFG = {"negative_prompt": "blurry, ugly", "true_cfg_scale": 3.0}


@pytest.mark.slow
async def test_cfg_batch_runs_both_guidance_branches_as_one_transformer_call_per_step(
    cfg_batched: Deployed, diffusers_pipe: Any
) -> None:
    prompt = "a shiny robot holding a sign that says hello world"  # longer than the negative: padded, masked
    expected = direct(diffusers_pipe, prompt, seed=12, n=2, width=48, **CFG)
    with block_batches(cfg_batched.engines["denoise"]) as sizes:
        got = await generate(cfg_batched, prompt, seed=12, n=2, width=48, **CFG)
    assert sizes == [4] * STEPS  # [positive; negative] of both images, once per step
    assert_rounding_only(expected, got)
    # Without guidance there is one branch: the pipeline's own single call, diffusers' pixels exactly.
    with block_batches(cfg_batched.engines["denoise"]) as sizes:
        plain = await generate(cfg_batched, prompt, seed=12)
    assert sizes == [1] * STEPS
    assert np.array_equal(plain, direct(diffusers_pipe, prompt, seed=12))


@pytest.mark.slow
async def test_cfg_batch_encodes_the_prompt_and_the_negative_prompt_in_one_text_encoder_pass(
    cfg_batched: Deployed, diffusers_pipe: Any
) -> None:
    prompt = "a shiny robot holding a sign that says hello world"  # longer than the negative: padded
    encode = cfg_batched.engines["encode"]
    rows: list[int] = []

    def record(_module: Any, _args: Any, kwargs: dict[str, Any]) -> None:
        rows.append(kwargs["input_ids"].shape[0])

    handle = encode._pipe.text_encoder.register_forward_pre_hook(record, with_kwargs=True)
    try:
        got = await generate(cfg_batched, prompt, seed=7, **CFG)
        await generate(cfg_batched, prompt, seed=7)  # no guidance: one prompt to encode
    finally:
        handle.remove()
    assert rows == [2, 1]
    assert_rounding_only(direct(diffusers_pipe, prompt, seed=7, **CFG), got)
    # Each row as the prompt's own encoding gives it: its tokens alone, no mask, rounded otherwise.
    family, length = QwenImageFamily(), encode._defaults.max_sequence_length
    with torch.inference_mode():
        alone = family.encode(diffusers_pipe, prompt, CFG["negative_prompt"], length).tensors
        together = family.encode_together(diffusers_pipe, prompt, CFG["negative_prompt"], length).tensors
    assert alone.keys() == together.keys() == {"prompt_embeds", "negative_prompt_embeds"}
    for name, row in alone.items():
        assert together[name].shape == row.shape
        torch.testing.assert_close(together[name], row, rtol=0, atol=1e-5 * float(row.abs().max()))


@pytest.mark.slow
async def test_cfg_batch_in_a_batch_of_requests_keeps_each_requests_image(cfg_batched: Deployed) -> None:
    negatives = ["blurry", "ugly, low quality, watermark, text", "dark", "noise"]  # of other lengths than PROMPTS
    kw = [{"seed": 300 + i, "negative_prompt": neg, "true_cfg_scale": 2.5} for i, neg in enumerate(negatives)]
    alone = [await generate(cfg_batched, p, **k) for p, k in zip(PROMPTS, kw, strict=True)]
    metrics = cfg_batched.metrics["denoise"]
    metrics.batches.clear()
    with block_batches(cfg_batched.engines["denoise"]) as sizes:
        together = await asyncio.gather(*(generate(cfg_batched, p, **k) for p, k in zip(PROMPTS, kw, strict=True)))
    assert metrics.batches == [len(PROMPTS)]
    assert sizes == [2 * len(PROMPTS)] * STEPS
    for one, batched in zip(alone, together, strict=True):
        assert_rounding_only(one, batched)


@pytest.mark.slow
async def test_fused_blocks_take_each_request_s_modulation_rows_from_its_own_schedule(
    tiny_t2i: Path, diffusers_pipe: Any
) -> None:
    # fuse_blocks with cfg_batch, as the GPU runs it. Two sizes: the scheduler shifts its timesteps by the
    # image's token count, so each request's table must be built from its own schedule (a table kept from
    # the first request would fail the second, whose timesteps are not in it).
    preset = get_preset("text-to-image").pipeline(ModelSource(source="tiny://x"))
    async with deploy(preset, tiny_t2i, cfg_batch=True, fuse_blocks=True) as deployed:
        modulations = getattr(deployed.engines["denoise"]._pipe.transformer, MODULATIONS)
        for width in (32, 64):
            built, (computed, looked_up) = modulations.tables_built, modulations.calls
            got = await generate(deployed, "a shiny robot holding a sign", seed=5, width=width, **CFG)
            assert modulations.tables_built == built + 1
            assert modulations.calls == [computed, looked_up + STEPS]  # one batched call a step
            assert_rounding_only(
                direct(diffusers_pipe, "a shiny robot holding a sign", seed=5, width=width, **CFG), got
            )


@pytest.mark.slow
async def test_batched_guidance_gives_the_pipelines_pixels_and_leaves_the_pipeline_as_it_was(
    diffusers_pipe: Any,
) -> None:
    family = QwenImageFamily()
    for negative in ("blurry, ugly", "a shiny robot holding a flag", " "):  # shorter, as long, shortest
        expected = direct(
            diffusers_pipe, "a shiny robot holding a sign", seed=4, n=2, negative_prompt=negative, true_cfg_scale=3.0
        )
        with BatchedGuidance(diffusers_pipe, family.merge_guidance) as guidance:
            got = direct(
                diffusers_pipe,
                "a shiny robot holding a sign",
                seed=4,
                n=2,
                negative_prompt=negative,
                true_cfg_scale=3.0,
            )
        assert (guidance.batched_calls, guidance.answered_calls) == (STEPS, STEPS)
        assert_rounding_only(expected, got)
    assert "forward" not in diffusers_pipe.transformer.__dict__
    assert "encode_prompt" not in diffusers_pipe.__dict__


async def test_bfloat16_crosses_the_wire_bit_for_bit() -> None:
    tensors = {"a": torch.randn(2, 3, 5).to(torch.bfloat16), "b": torch.arange(4, dtype=torch.int64)}
    arrays, dtypes = to_wire(tensors)
    assert dtypes == {"a": "bfloat16"}
    assert arrays["a"].dtype == np.int16
    back = from_wire({k: v.copy() for k, v in arrays.items()}, dtypes, "cpu")
    assert back["a"].dtype == torch.bfloat16
    assert torch.equal(back["a"], tensors["a"])
    assert torch.equal(back["b"], tensors["b"])


@pytest.mark.slow
async def test_vae_2d_decodes_single_frames_with_2d_convolutions_and_keeps_the_pixels(
    tiny_t2i: Path, diffusers_pipe: Any
) -> None:
    # vae_2d on every stage that has the VAE (here decode): each causal 3D convolution of the decoder runs
    # as its last time tap's 2D convolution, so no 3D convolution runs at all; the skipped taps only met
    # the zero frames in front, so the pixels are diffusers' (other rounding: one level at most).
    preset = get_preset("text-to-image").pipeline(ModelSource(source="tiny://x"))
    async with deploy(preset, tiny_t2i, vae_2d=True) as deployed:
        with conv3d_calls() as calls:
            got = await generate(deployed, "a lighthouse at night", seed=21, width=48)
    assert calls == []
    expected = direct(diffusers_pipe, "a lighthouse at night", seed=21, width=48)
    assert_rounding_only(expected, got)
