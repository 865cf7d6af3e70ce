"""The text-to-image engine's speed options (``engine_args``: ``attention``, ``cache``, ``fuse_blocks``) on the
tiny Qwen-Image pipeline on CPU, applied by the engine's own code to diffusers' pipeline: what each one changes,
and that it is refused by name when misspelt. (``compile: regional`` and ``cfg_batch`` have their GPU figures in
bench/README.md; ``cfg_batch`` is tested through the engine in test_t2i_engine.py.)"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from stage_engines import conv3d_calls, diffusers_pipeline

from omnimodel_runtime.engines.t2i.fused import MODULATIONS, ModulationSchedule, fuse_blocks, unfuse_blocks
from omnimodel_runtime.engines.t2i.guidance import BatchedGuidance
from omnimodel_runtime.engines.t2i.qwen_image import QwenImageFamily
from omnimodel_runtime.engines.t2i.speed import speed_up as apply_speed_options
from omnimodel_runtime.engines.t2i.vae import undo_vae_2d, vae_2d

pytestmark = pytest.mark.engine

STEPS = 10
PROMPT = "a red fox in the snow"


@pytest.fixture(scope="module")
def pipe(tiny_t2i: Path) -> Any:
    return diffusers_pipeline("QwenImagePipeline", tiny_t2i, dtype=torch.float32)


def speed_up(pipe: Any, **engine_args: Any) -> None:
    """The engine's own speed options for these engine_args, on ``pipe`` (what the engine does at load)."""
    stage = SimpleNamespace(engine_args=engine_args, name="t2i")
    apply_speed_options(pipe, stage)  # type: ignore[arg-type]


def image(pipe: Any) -> np.ndarray:
    out = pipe(
        PROMPT,
        negative_prompt=" ",
        true_cfg_scale=4.0,
        width=64,
        height=64,
        num_inference_steps=STEPS,
        generator=torch.Generator("cpu").manual_seed(3),
    ).images[0]
    return np.asarray(out).astype(np.int16)


@pytest.fixture(scope="module")
def exact(pipe: Any) -> np.ndarray:
    return image(pipe)


@pytest.fixture
def block_calls(pipe: Any) -> Iterator[list[int]]:
    """How many times the first transformer block's attention computed (its query projection ran: TaylorSeer
    hooks the attention module itself and answers predicted steps without running its insides)."""
    calls: list[int] = []
    hook = pipe.transformer.transformer_blocks[0].attn.to_q.register_forward_hook(lambda *_: calls.append(1))
    yield calls
    hook.remove()


@pytest.mark.slow
def test_a_pinned_attention_kernel_draws_the_same_image(pipe: Any, exact: np.ndarray) -> None:
    # On CPU PyTorch's own choice for these unmasked fp32 calls is its flash kernel; pinning it changes nothing.
    speed_up(pipe, attention="flash")
    try:
        assert {type(p).__name__ for p in pipe.transformer.attn_processors.values()}  # the processors stay
        assert np.array_equal(image(pipe), exact)
    finally:
        pipe.transformer.set_attention_backend("native")


@pytest.mark.slow
def test_a_pinned_kernel_that_cannot_serve_the_call_fails_it(pipe: Any) -> None:
    # cuDNN's attention exists on CUDA only: the engine does not fall back quietly to another kernel.
    speed_up(pipe, attention="cudnn")
    try:
        with pytest.raises(RuntimeError):
            image(pipe)
    finally:
        pipe.transformer.set_attention_backend("native")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "named"),
    [
        ({"attention": "sage"}, "engine_args.attention"),
        ({"cache": "teacache"}, "engine_args.cache"),
        ({"compile": "full"}, "engine_args.compile"),
        ({"cache": "taylorseer", "cache_scope": "layers"}, "engine_args.cache_scope"),
        ({"cache": "taylorseer", "compile": "regional"}, "engine_args.cache_scope: blocks"),
    ],
)
def test_a_misspelt_speed_option_is_refused_by_name(pipe: Any, args: dict[str, str], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        speed_up(pipe, **args)
    # Refused before anything was changed on the pipeline.
    assert all("forward" not in vars(block) for block in pipe.transformer.transformer_blocks)


@pytest.mark.slow
def test_taylorseer_skips_block_steps_and_stays_near_the_exact_image(
    pipe: Any, exact: np.ndarray, block_calls: list[int]
) -> None:
    speed_up(pipe, cache="taylorseer", cache_interval=3, cache_warmup=3)
    try:
        cached = image(pipe)
    finally:
        pipe.transformer.disable_cache()
    # True CFG: two transformer calls a step. Steps 0-2 run the blocks, then every third one does (diffusers
    # 0.42: steps 5 and 8 of 10), so about half of the block work is skipped.
    assert 2 * 3 <= len(block_calls) <= STEPS
    diff = np.abs(cached - exact)
    assert diff.max() > 0  # the skipped steps are predicted, not computed
    assert diff.max() <= 2, f"max pixel difference {diff.max()}"  # measured: 1 (mean 0.12) of 255


@pytest.fixture
def mlp_calls(pipe: Any) -> Iterator[list[int]]:
    """How many times the first transformer block's image MLP ran (it runs whenever the block computes; an
    attention-scoped cache leaves it running every step)."""
    calls: list[int] = []
    hook = pipe.transformer.transformer_blocks[0].img_mlp.register_forward_hook(lambda *_: calls.append(1))
    yield calls
    hook.remove()


@pytest.mark.slow
def test_a_block_scoped_taylorseer_skips_whole_blocks(pipe: Any, exact: np.ndarray, mlp_calls: list[int]) -> None:
    speed_up(pipe, cache="taylorseer", cache_interval=3, cache_warmup=3, cache_scope="blocks")
    try:
        cached = image(pipe)
    finally:
        pipe.transformer.disable_cache()
    # Two transformer calls a step; the block computes on the same steps as the attention-scoped cache's
    # attention does, so its MLP runs there only (20 times uncached).
    assert 2 * 3 <= len(mlp_calls) <= STEPS
    diff = np.abs(cached - exact)
    assert 0 < diff.max() <= 3, f"max pixel difference {diff.max()}"  # measured: 2 of 255


# Inductor's CPU code generation imports a torch.jit helper that warns about itself (torch 2.13), and leaves
# Qwen-Image's complex-number rotary embedding to eager kernels (it says so; the GPU figures include that).
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:Torchinductor does not support code generation for complex operators:UserWarning")
def test_compiled_blocks_under_the_block_cache_draw_the_eager_cached_image(pipe: Any) -> None:
    from torch._dynamo.utils import counters

    args = {"cache": "taylorseer", "cache_interval": 3, "cache_warmup": 3, "cache_scope": "blocks"}
    speed_up(pipe, **args)
    try:
        eager_cached = image(pipe)
    finally:
        pipe.transformer.disable_cache()
    graphs = counters["stats"]["unique_graphs"]
    speed_up(pipe, **args, compile="regional")
    try:
        compiled_cached = image(pipe)
        compiled = counters["stats"]["unique_graphs"] - graphs
    finally:
        pipe.transformer.disable_cache()
        for block in pipe.transformer.transformer_blocks:
            del block.forward  # the class's eager forward again, for the other tests
    # The blocks' compiled forward ran under the cache hooks (fullgraph: one graph, no breaks), and on CPU
    # in float32 the compiled kernels round like the eager ones to within a level.
    assert compiled >= 1
    diff = np.abs(compiled_cached - eager_cached)
    assert diff.max() <= 1, f"max pixel difference {diff.max()}"  # measured: 0


@pytest.fixture
def fused(pipe: Any) -> Iterator[Any]:
    """``fuse_blocks`` on the module's pipeline, undone afterwards for the other tests."""
    speed_up(pipe, fuse_blocks=True)
    try:
        yield pipe
    finally:
        unfuse_blocks(pipe.transformer)


@pytest.mark.slow
def test_fused_blocks_draw_diffusers_image(fused: Any, exact: np.ndarray) -> None:
    # The rotation in real arithmetic and the MLP's product + GELU as one op: on CPU in float32 the same
    # operations (the GPU's epilogue rounds once less; bench/t2i_kernels.py states it). The attention runs
    # over [image; text] instead of diffusers' [text; image]: the same softmax, its sums in another order.
    assert {type(p).__name__ for p in fused.transformer.attn_processors.values()} == {"FusedDoubleStreamProcessor"}
    diff = np.abs(image(fused) - exact)
    assert diff.max() <= 1, f"max pixel difference {diff.max()}"  # measured: 1, one value of 12288


@pytest.fixture
def text_lengths(pipe: Any) -> Iterator[list[Any]]:
    """The ``text_lengths`` attention kwarg of every call of the first block's attention."""
    seen: list[Any] = []

    def record(_module: Any, _args: Any, kwargs: dict[str, Any]) -> None:
        seen.append(kwargs.get("text_lengths"))

    handle = pipe.transformer.transformer_blocks[0].attn.register_forward_pre_hook(record, with_kwargs=True)
    yield seen
    handle.remove()


@pytest.mark.slow
def test_fused_blocks_under_cfg_batch_attend_each_branch_over_its_own_prompt(
    fused: Any, exact: np.ndarray, text_lengths: list[Any]
) -> None:
    # The positive prompt is longer than the negative " ": one call a step on [positive; negative], the
    # negative right-padded; each row attends unmasked over its real tokens, as its own call would.
    with BatchedGuidance(fused, QwenImageFamily().merge_guidance) as guidance:
        got = image(fused)
    assert guidance.batched_calls == guidance.answered_calls == STEPS
    (lengths,) = set(text_lengths)
    positive = fused.encode_prompt(PROMPT, device="cpu")[0].shape[1]
    negative = fused.encode_prompt(" ", device="cpu")[0].shape[1]
    assert lengths == (positive, negative) and positive > negative
    diff = np.abs(got - exact)
    assert diff.max() <= 1, f"max pixel difference {diff.max()}"  # batched products' rounding


@pytest.mark.slow
@pytest.mark.parametrize("batched", [False, True], ids=["sequential-cfg", "cfg-batch"])
def test_a_modulation_schedule_computes_every_step_s_rows_once_and_draws_the_exact_image(
    fused: Any, exact: np.ndarray, batched: bool
) -> None:
    # As the engine runs a request: the schedule over the pipeline call, under cfg_batch or not. The rows
    # are computed by the first call, for all the scheduler's timesteps; every call copies its step's.
    modulations = getattr(fused.transformer, MODULATIONS)
    computed, looked_up = modulations.calls
    guidance = BatchedGuidance(fused, QwenImageFamily().merge_guidance) if batched else contextlib.nullcontext()
    with guidance, ModulationSchedule(fused):
        got = image(fused)
    assert modulations.calls == [computed, looked_up + (STEPS if batched else 2 * STEPS)]
    assert modulations.table is None and modulations.scheduler is None  # nothing left for a plain call
    diff = np.abs(got - exact)
    assert diff.max() <= 1, f"max pixel difference {diff.max()}"  # products over 10 rows, not 1 or 2


def _transformer_call(transformer: Any, timestep: float) -> torch.Tensor:
    config = transformer.config
    gen = torch.Generator().manual_seed(1)
    out: torch.Tensor = transformer(
        hidden_states=torch.randn(1, 16, config.in_channels, generator=gen),
        encoder_hidden_states=torch.randn(1, 5, config.joint_attention_dim, generator=gen),
        timestep=torch.tensor([timestep]),
        img_shapes=[[(1, 4, 4)]],
        return_dict=False,
    )[0]
    return out


@pytest.mark.slow
def test_a_call_off_the_schedule_fails_its_schedule_instead_of_taking_another_step_s_rows(fused: Any) -> None:
    schedule = SimpleNamespace(
        transformer=fused.transformer, scheduler=SimpleNamespace(timesteps=torch.tensor([900.0, 500.0]))
    )
    plain = _transformer_call(fused.transformer, 0.5)
    with torch.no_grad(), ModulationSchedule(schedule):
        on = _transformer_call(fused.transformer, 0.5)  # 500 / 1000: on the schedule
    assert torch.allclose(on, plain, atol=1e-5)
    with pytest.raises(RuntimeError, match="timestep"), torch.no_grad(), ModulationSchedule(schedule):
        _transformer_call(fused.transformer, 0.7)
    # Outside a schedule a call computes its own rows again.
    assert torch.equal(_transformer_call(fused.transformer, 0.5), plain)


def test_fusing_a_transformer_without_qwen_image_blocks_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"engine_args\.fuse_blocks"):
        fuse_blocks(SimpleNamespace(transformer_blocks=[SimpleNamespace(attn=None)]))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_compiled_fused_blocks_under_cfg_batch_compile_whole_and_draw_the_exact_image(
    pipe: Any, exact: np.ndarray, text_lengths: list[Any]
) -> None:
    # What the GPU runs: fuse_blocks + compile: regional + cfg_batch. fullgraph=True, so a graph break in
    # the fused processor (the per-row split, the custom GELU op) fails the call instead of running eagerly;
    # and no complex tensor reaches inductor (it would warn, and pytest turns warnings into errors).
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    speed_up(pipe, fuse_blocks=True, compile="regional")
    try:
        with BatchedGuidance(pipe, QwenImageFamily().merge_guidance) as guidance:
            got = image(pipe)
        compiled = counters["stats"]["unique_graphs"] - graphs
    finally:
        unfuse_blocks(pipe.transformer)
        for block in pipe.transformer.transformer_blocks:
            block._compiled_call_impl = None  # the eager module call again, for the other tests
    assert compiled >= 1
    assert guidance.batched_calls == STEPS
    assert len(set(text_lengths)) == 1 and None not in text_lengths
    diff = np.abs(got - exact)
    assert diff.max() <= 1, f"max pixel difference {diff.max()}"


@pytest.mark.slow
def test_fused_cfg_batch_of_several_images_gives_each_row_its_own_prompt_length(
    fused: Any, text_lengths: list[Any]
) -> None:
    # Two images of one request: rows [positive, positive, negative, negative], each with its length.
    def two() -> np.ndarray:
        out = fused(
            PROMPT,
            negative_prompt=" ",
            true_cfg_scale=4.0,
            width=64,
            height=64,
            num_inference_steps=STEPS,
            num_images_per_prompt=2,
            generator=[torch.Generator("cpu").manual_seed(s) for s in (5, 6)],
            output_type="np",
        ).images
        return np.asarray((out * 255).round()).astype(np.int16)

    sequential = two()
    with BatchedGuidance(fused, QwenImageFamily().merge_guidance):
        batched = two()
    positive, negative = (fused.encode_prompt(p, device="cpu")[0].shape[1] for p in (PROMPT, " "))
    assert set(text_lengths) == {None, (positive, positive, negative, negative)}
    diff = np.abs(batched - sequential)
    assert diff.max() <= 1, f"max pixel difference {diff.max()}"


# Triton's interpreter runs the kernel's program on CPU tensors; it is chosen when the kernel is decorated, so
# the pipeline runs in a process of its own with TRITON_INTERPRET set before the kernel's lazy import.
_INTERPRETED_KERNEL = """
import json, os, sys
os.environ["TRITON_INTERPRET"] = "1"
import numpy as np, torch
from stage_engines import diffusers_pipeline
from omnimodel_runtime.engines.t2i import fused, kernels
from omnimodel_runtime.engines.t2i.qwen_image import QwenImageFamily
from omnimodel_runtime.engines.t2i.guidance import BatchedGuidance
from omnimodel_runtime.engines.t2i.speed import speed_up as apply_speed_options

pipe = diffusers_pipeline("QwenImagePipeline", sys.argv[1], dtype=torch.float32)
def image():
    out = pipe({prompt!r}, negative_prompt=" ", true_cfg_scale=4.0, width=64, height=64,
               num_inference_steps={steps}, generator=torch.Generator("cpu").manual_seed(3)).images[0]
    return np.asarray(out).astype(np.int16)
exact = image()
fused.fuse_blocks(pipe.transformer)
launches = []
launch = kernels.launch_norm_rope_qk
def counted(*args):
    launches.append(1)
    return launch(*args)
kernels.launch_norm_rope_qk = counted
fused._kernel_applies = lambda *_: True  # what CUDA decides on the GPU
sequential = image()
with BatchedGuidance(pipe, QwenImageFamily().merge_guidance):
    batched = image()
result = {{"sequential": exact.tolist(), "got": [sequential.tolist(), batched.tolist()], "launches": len(launches)}}
print(json.dumps(result))
"""


@pytest.mark.slow
def test_the_norm_rope_kernel_writes_the_joint_queries_and_keys_that_draw_diffusers_image(tiny_t2i: Path) -> None:
    # On the GPU (engines/t2i/kernels.py) one Triton launch a block norms and rotates both streams' queries and
    # keys into the joint [image; text] tensors, a program a (32 tokens x head x query or key). Here the same
    # program, interpreted on CPU in float32, in the fused pipeline: sequential CFG (two streams a call, a
    # partial last token block) and cfg_batch (rows of two prompt lengths).
    script = _INTERPRETED_KERNEL.format(prompt=PROMPT, steps=STEPS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    run = subprocess.run(
        [sys.executable, "-c", script, str(tiny_t2i)], check=False, env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.splitlines()[-1])
    exact = np.asarray(result["sequential"])
    # One launch a block for both streams' queries and keys: 2 blocks a call, 2 calls a step sequentially, 1
    # batched.
    assert result["launches"] == STEPS * 2 * 3
    for got in result["got"]:
        diff = np.abs(np.asarray(got) - exact)
        assert diff.max() <= 1, f"max pixel difference {diff.max()}"  # measured: 1, as the PyTorch path's


def test_vae_2d_on_a_vae_without_causal_3d_convolutions_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"engine_args\.vae_2d"):
        vae_2d(torch.nn.Sequential(torch.nn.Conv2d(3, 3, 3)))


@pytest.mark.slow
def test_vae_2d_decodes_and_encodes_one_frame_as_diffusers_does_and_undoes(pipe: Any) -> None:
    # Every causal convolution's single-frame output from its last time tap alone: no 3D convolution runs
    # (the encoder's time-strided one only runs on later frames), float32 on CPU gives the same values up to
    # the sums' order, both ways through the VAE; undone, diffusers' own convolutions again.
    vae = pipe.vae
    gen = torch.Generator().manual_seed(5)
    latents = torch.randn(1, vae.config.z_dim, 1, 6, 10, generator=gen)
    image = torch.rand(1, 3, 1, 48, 80, generator=gen) * 2 - 1
    with torch.inference_mode(), conv3d_calls() as calls:
        decoded, encoded = vae.decode(latents).sample, vae.encode(image).latent_dist.mode()
        diffusers_calls = len(calls)
        vae_2d(vae)
        try:
            decoded_2d, encoded_2d = vae.decode(latents).sample, vae.encode(image).latent_dist.mode()
            assert len(calls) == diffusers_calls > 0
        finally:
            undo_vae_2d(vae)
        again = vae.decode(latents).sample
    torch.testing.assert_close(decoded_2d, decoded, rtol=0, atol=1e-5)
    torch.testing.assert_close(encoded_2d, encoded, rtol=0, atol=1e-5)
    assert torch.equal(again, decoded)
