"""Text to video on ``diffusers``: the whole ``WanPipeline`` (Wan2.1 or Wan2.2, one transformer or two
experts) in one stage, one video at a time.

A request's frames come from one ``pipe(...)`` call with a CPU ``torch.Generator`` seeded from the request,
so the same seed gives the same video as diffusers called directly (and on any device: diffusers draws the
noise on the CPU and moves it). What the stage sends back, in order:

- at once, from ``generate()`` on the event loop: a ``TensorFrame`` without tensors whose
  ``meta["accepted"]`` holds what the request resolved to (size, frames, fps), after every check against
  the model — so a gateway can wait for it and still answer a bad request with a 400;
- from the worker: ``meta["progress"]`` frames (0 when the job starts, then after each denoising step, in
  percent; 100 only with the result);
- one ``TensorFrame``: the MP4 file (:data:`VIDEO_TENSOR`, encoded here with PyAV, so only the file
  crosses to the gateway) or, with ``output="frames"``, the uint8 frames (:data:`FRAMES_TENSOR`);
- a ``FinalFrame``;
- and every :data:`KEEPALIVE` seconds (``engine_args.keepalive``) until then, ``meta["keepalive"]`` frames
  (nothing else in them).

Videos are not batched: one Wan video already fills an accelerator for minutes, so a second one waits in
the queue. A caller that goes away (a deleted job) stops the denoise loop at its next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import torch
from diffusers import AutoencoderKLWan, DiffusionPipeline, WanPipeline
from diffusers.utils import logging as diffusers_logging
from transformers.utils import logging as hf_logging

from omnimodel_runtime.engines.base import EngineContext
from omnimodel_runtime.engines.devices import resolve_device, torch_dtype
from omnimodel_runtime.engines.loading import LOAD_LOCK
from omnimodel_runtime.engines.t2v.mp4 import encode_mp4
from omnimodel_runtime.engines.worker import CancelledRequestError, Job, WorkerEngine
from omnimodel_runtime.errors import StageError
from omnimodel_runtime.protocol.stage import (
    FinalFrame,
    ResponseFrame,
    StageInput,
    StageParams,
    StageRequest,
    TensorFrame,
)
from omnimodel_runtime.protocol.videos import FRAMES_TENSOR, VIDEO_TENSOR, TextToVideoParams

log = logging.getLogger(__name__)

# Wan2.2-T2V-A14B's frame rate (its 81 default frames are ~5 s); engine_args.fps overrides it.
DEFAULT_FPS: Final = 16
# Seconds between keep-alive frames. A job may wait minutes in the queue behind other videos, and a VAE
# decode sends nothing for tens of seconds; a gateway reading a remote stage gives up after its stage read
# timeout (120 s by default) without a frame, which must mean a stage that stopped answering, not a queue.
KEEPALIVE: Final = 15.0


@dataclass(frozen=True)
class VideoDefaults:
    """What the loaded pipeline fixes: its ``__call__`` defaults and its size and length rules."""

    width: int
    height: int
    num_frames: int
    steps: int
    guidance_scale: float
    fps: int
    # Sides are multiples of this (VAE spatial factor x transformer patch).
    multiple: int
    # Frame counts are ``temporal * k + 1`` (the VAE's temporal compression keeps the first frame alone).
    temporal: int
    # The largest side and frame count whose patches the transformer's rotary embedding has positions for
    # (``rope_max_seq_len`` along each axis): a larger video fails inside the forward pass.
    max_side: int
    max_frames: int
    # Wan2.2's high- and low-noise experts: only then does guidance_scale_2 mean anything.
    two_experts: bool


@dataclass(frozen=True)
class Resolved:
    """A request's parameters with every default filled in and checked against the model."""

    width: int
    height: int
    num_frames: int
    fps: int
    steps: int
    guidance_scale: float
    guidance_scale_2: float | None
    negative_prompt: str | None
    seed: int
    output: str

    def accepted(self) -> dict[str, int]:
        return {"width": self.width, "height": self.height, "num_frames": self.num_frames, "fps": self.fps}


def resolve(params: TextToVideoParams, defaults: VideoDefaults) -> Resolved:
    """``params`` against the model: a 400 naming the field for a size or length the model cannot make."""
    width = params.width if params.width is not None else defaults.width
    height = params.height if params.height is not None else defaults.height
    m = defaults.multiple
    if width % m or height % m:
        raise StageError(
            f"size: {width}x{height} is not a size this model makes: width and height must be multiples of {m}",
            status=400,
            param="size",
        )
    if max(width, height) > defaults.max_side:
        raise StageError(
            f"size: {width}x{height} is larger than this model makes: at most {defaults.max_side} pixels a side",
            status=400,
            param="size",
        )
    if params.guidance_scale_2 is not None and not defaults.two_experts:
        raise StageError(
            "guidance_scale_2: this model has one transformer; guidance_scale_2 sets the low-noise expert's "
            "guidance of a two-expert (Wan2.2) model",
            status=400,
            param="guidance_scale_2",
        )
    fps = params.fps if params.fps is not None else defaults.fps
    t = defaults.temporal
    if params.num_frames is not None:
        frames = params.num_frames
        if frames % t != 1 % t:
            below = max(1, (frames - 1) // t * t + 1)
            raise StageError(
                f"num_frames: this model makes {t}k+1 frames (..., {below}, {below + t}, ...), not {frames}",
                status=400,
                param="num_frames",
            )
    elif params.seconds is not None:
        # The nearest frame count of the model's form (a 4 s request at 16 fps gets 65 frames, 4.06 s).
        frames = max(1, round(params.seconds * fps / t) * t + 1)
    else:
        frames = defaults.num_frames
    if frames > defaults.max_frames:
        param = "seconds" if params.seconds is not None else "num_frames"
        raise StageError(
            f"{param}: {frames} frames are more than this model makes (at most {defaults.max_frames})",
            status=400,
            param=param,
        )
    return Resolved(
        width=width,
        height=height,
        num_frames=frames,
        fps=fps,
        steps=params.num_inference_steps or defaults.steps,
        guidance_scale=params.guidance_scale if params.guidance_scale is not None else defaults.guidance_scale,
        guidance_scale_2=params.guidance_scale_2,
        negative_prompt=params.negative_prompt,
        seed=params.seed if params.seed is not None else secrets.randbits(62),
        output=params.output,
    )


def to_uint8(frames: np.ndarray) -> np.ndarray:
    """``WanPipeline``'s ``output_type="np"`` frames (floats in [0, 1]) → uint8, as diffusers'
    ``export_to_video`` writes them."""
    return (np.asarray(frames) * 255).round().clip(0, 255).astype(np.uint8)


@dataclass(eq=False, kw_only=True)
class _Job(Job):
    params: Resolved


class DiffusersVideoEngine(WorkerEngine[_Job]):
    """``diffusers`` adapter for ``text-to-video`` (``WanPipeline``)."""

    def __init__(self, context: EngineContext) -> None:
        super().__init__(context)
        args = dict(context.stage.engine_args)
        self._device = resolve_device(context.settings.device)
        dtype = torch_dtype(args.get("dtype"), self._device)
        # diffusers has no "auto" dtype; Wan's transformers ship in bf16.
        self._dtype = torch.bfloat16 if dtype == "auto" else dtype
        self._fps = int(args.get("fps", DEFAULT_FPS))
        self._pipe: Any = None
        self._defaults: VideoDefaults | None = None
        self.keepalive = float(args.get("keepalive", KEEPALIVE))

    @property
    def defaults(self) -> VideoDefaults:
        if self._defaults is None:
            raise StageError("the engine is not running", status=503, type="service_unavailable")
        return self._defaults

    # ------------------------------------------------------------------ event loop side

    async def warmup(self) -> None:
        """The smallest video the model makes, two steps, through the whole code path (MP4 included)."""
        side, frames = self.defaults.multiple, self.defaults.temporal + 1
        video = TextToVideoParams(width=side, height=side, num_frames=frames, num_inference_steps=2, seed=0)
        request = StageRequest(
            request_id=f"warmup-{secrets.token_hex(4)}", prompt="Warm up.", params=StageParams(video=video)
        )
        async for _ in self.generate(StageInput(request=request)):
            pass

    async def generate(self, inp: StageInput) -> AsyncIterator[ResponseFrame]:
        self.require_running()
        request = inp.request
        if not (request.prompt or "").strip():
            raise StageError("prompt must not be empty", status=400, param="prompt")
        params = resolve(request.params.video or TextToVideoParams(), self.defaults)
        yield TensorFrame(tensors={}, meta={"accepted": params.accepted()})
        job = _Job(request=request, params=params)
        beat = asyncio.create_task(self._keepalive(job))
        try:
            async with contextlib.aclosing(self.stream(job)) as frames:
                async for frame in frames:
                    yield frame
        finally:
            beat.cancel()

    async def _keepalive(self, job: _Job) -> None:
        """A keep-alive frame into the job's stream every :attr:`keepalive` seconds (on the event loop, the
        side that owns the job's queue), until the request ends."""
        while True:
            await asyncio.sleep(self.keepalive)
            job.out.put_nowait(TensorFrame(tensors={}, meta={"keepalive": True}))

    # ------------------------------------------------------------------ worker thread

    def worker_mode(self) -> contextlib.AbstractContextManager[Any]:
        return torch.inference_mode()

    def load(self) -> None:
        diffusers_logging.disable_progress_bar()
        hf_logging.disable_progress_bar()
        model_dir = self.context.model_dir
        with LOAD_LOCK:
            # Wan's VAE runs in float32 (diffusers' Wan examples load it so: its decoder loses detail in
            # bf16); the transformers and text encoder in the engine's dtype.
            vae = AutoencoderKLWan.from_pretrained(model_dir, subfolder="vae", dtype=torch.float32)
            pipe = DiffusionPipeline.from_pretrained(model_dir, vae=vae, dtype=self._dtype)
            pipe.to(self._device)
        if not isinstance(pipe, WanPipeline):
            raise ValueError(f"{model_dir} holds a {type(pipe).__name__}, not a WanPipeline (text-to-video)")
        pipe.set_progress_bar_config(disable=True)
        self._pipe = pipe
        call = inspect.signature(WanPipeline.__call__).parameters
        transformer = pipe.transformer if pipe.transformer is not None else pipe.transformer_2
        multiple = int(pipe.vae_scale_factor_spatial * transformer.config.patch_size[1])
        temporal = int(pipe.vae_scale_factor_temporal)
        positions = int(transformer.config.rope_max_seq_len)
        self._defaults = VideoDefaults(
            width=int(call["width"].default),
            height=int(call["height"].default),
            num_frames=int(call["num_frames"].default),
            steps=int(call["num_inference_steps"].default),
            guidance_scale=float(call["guidance_scale"].default),
            fps=self._fps,
            multiple=multiple,
            temporal=temporal,
            max_side=positions * multiple,
            # Latent frames are (frames - 1) / temporal + 1, cut into patches of patch_size[0] frames.
            max_frames=(positions * int(transformer.config.patch_size[0]) - 1) * temporal + 1,
            two_experts=pipe.transformer_2 is not None and pipe.config.boundary_ratio is not None,
        )
        log.info(
            "Loaded WanPipeline (%s) from %s on %s (%s) for stage %s",
            "two experts" if pipe.transformer_2 is not None else "one transformer",
            model_dir,
            self._device,
            self._dtype,
            self.stage.name,
        )

    def serve(self) -> None:
        while not self.stopping:
            job = self.take()
            if job is None or job.cancelled:
                continue
            if self.drop_if_expired(job):
                self.flush()
                continue
            try:
                self._run(job)
            except CancelledRequestError:
                pass
            except Exception as err:
                self.fail(job, err)
            self.flush()

    def _run(self, job: _Job) -> None:
        params = job.params
        self.send(job, TensorFrame(tensors={}, meta={"progress": 0}))
        frames = self.frames(job)
        self.check(job)
        if params.output == "frames":
            tensors = {FRAMES_TENSOR: frames}
        else:
            tensors = {VIDEO_TENSOR: np.frombuffer(encode_mp4(frames, params.fps), dtype=np.uint8)}
        meta = {"modality": "video", **params.accepted()}
        self.emit(job, TensorFrame(tensors=tensors, meta=meta))
        self.emit(job, FinalFrame("stop"))

    def frames(self, job: _Job) -> np.ndarray:
        """The request's video as uint8 ``(frames, height, width, 3)``: one ``WanPipeline`` call."""
        params = job.params

        def step_end(pipe: Any, step: int, timestep: Any, tensors: dict[str, Any]) -> dict[str, Any]:
            if job.cancelled or job.expired or self.stopping:
                # Nobody wants the rest: skip the remaining steps (check() then says why).
                pipe._interrupt = True
            else:
                self.send(job, TensorFrame(tensors={}, meta={"progress": (step + 1) * 100 // (params.steps + 1)}))
            return {}

        result = self._pipe(
            prompt=job.request.prompt,
            negative_prompt=params.negative_prompt,
            height=params.height,
            width=params.width,
            num_frames=params.num_frames,
            num_inference_steps=params.steps,
            guidance_scale=params.guidance_scale,
            guidance_scale_2=params.guidance_scale_2,
            generator=torch.Generator("cpu").manual_seed(params.seed),
            output_type="np",
            callback_on_step_end=step_end,
        )
        self.check(job)
        return to_uint8(result.frames[0])
