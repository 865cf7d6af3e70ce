"""Text-to-image on ``diffusers``: the whole pipeline in one stage, or one of its encode / denoise / decode
stages, with request batching in denoise.

The task picks the role: ``text-to-image`` (whole), ``t2i-encode``, ``t2i-denoise``, ``t2i-decode``; for a
pipeline that edits an input image, ``image-edit`` (whole), ``image-edit-encode``, ``image-edit-denoise``,
``image-edit-decode`` (the image file comes with the request as ``media[0]``; encode sends its VAE latents
beside the embeddings; a masked edit's mask file is ``media[1]``, and denoise then runs the family's
inpainting pipeline, docs/pipelines/qwen-image-edit.md). Each role loads only its components
(:mod:`~omnimodel_runtime.engines.t2i.family` says which and how the pipeline splits). What travels between stages:

- encode → denoise: one ``TensorFrame`` with the prompt embeddings (and negative ones when classifier-
  free guidance is on; masks only where the pipeline has them; for an edit, the input image's VAE
  ``image_latents``; for a masked edit also ``mask_condition`` and the image generators'
  ``generator_states``), one row per request;
- denoise → decode: one ``TensorFrame`` with the packed latents of the request's ``n`` images;
- decode (or whole) → client: one ``TensorFrame`` with ``images``, ``(n, H, W, 3)`` uint8.

bfloat16 has no numpy dtype: such tensors cross as their raw 16-bit patterns (int16), with the true
dtype in ``meta["dtypes"]``, so nothing is rounded on the way.

All model work runs on the engine's worker thread (:class:`~omnimodel_runtime.engines.worker.WorkerEngine`);
the event loop only validates, submits and relays the frames the worker posts back.

Speed options (``engine_args``: ``compile``, ``cache``, ``attention``, ``fuse_blocks``, ``cfg_batch``, ``vae_2d``;
off by default, so the output is diffusers' own): :mod:`~omnimodel_runtime.engines.t2i.speed` says what each
does; ``cfg_batch`` is applied here (:mod:`~omnimodel_runtime.engines.t2i.guidance`), ``vae_2d`` by
:mod:`~omnimodel_runtime.engines.t2i.vae`.

Request batching (denoise and whole): requests with the same size, steps and guidance run as one
``pipe(...)`` call, each image with its own CPU ``torch.Generator`` seeded ``seed + i``, so its initial
noise is the one it gets alone. A request is *announced* when its ``generate()`` starts — in a split
pipeline that is when the chain starts, before its embeddings exist — and a batch ready to run waits up
to ``batch_wait`` seconds for announced compatible requests whose inputs are still on their way. A
request nobody else is coming for starts at once, so batching adds no latency to a lone request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import torch
from diffusers import DiffusionPipeline
from diffusers.utils import logging as diffusers_logging
from transformers.utils import logging as hf_logging

from omnimodel_runtime.engines.base import EngineContext, flag
from omnimodel_runtime.engines.devices import resolve_device, torch_dtype
from omnimodel_runtime.engines.images import decode_image, decode_mask
from omnimodel_runtime.engines.loading import LOAD_LOCK
from omnimodel_runtime.engines.t2i.families import family_for
from omnimodel_runtime.engines.t2i.family import Conditioning, Family, PipelineDefaults
from omnimodel_runtime.engines.t2i.guidance import BatchedGuidance
from omnimodel_runtime.engines.t2i.qwen_image import GENERATOR_STATES, IMAGE_LATENTS, MASK_CONDITION, restore_generators
from omnimodel_runtime.engines.t2i.requests import EDIT_TASKS, ROLES, Announcements, Resolved, Role, resolve
from omnimodel_runtime.engines.t2i.speed import speed_up
from omnimodel_runtime.engines.t2i.wire import from_wire, to_wire, upstream_tensors
from omnimodel_runtime.engines.worker import Job, WorkerEngine
from omnimodel_runtime.errors import StageError
from omnimodel_runtime.protocol.images import IMAGES_TENSOR, ImageEditParams, TextToImageParams
from omnimodel_runtime.protocol.stage import (
    FinalFrame,
    MediaInput,
    ResponseFrame,
    StageInput,
    StageParams,
    StageRequest,
    TensorFrame,
    Usage,
)

log = logging.getLogger(__name__)

# A diffusion request takes seconds; waiting a fraction of that for announced requests to join a batch
# costs little, and only happens when some are actually on their way.
DEFAULT_BATCH_WAIT: Final = 0.25
# Images per denoise call. Memory grows with it; throughput stops growing once the GPU is busy.
DEFAULT_MAX_BATCH: Final = 8

LATENTS: Final = "latents"


@dataclass(eq=False, kw_only=True)
class _Job(Job):
    """One request inside the worker; everything but ``cancelled`` is set before it is submitted or
    belongs to the worker thread."""

    params: Resolved
    # Wire tensors from the upstream stage (denoise: embeddings; decode: latents).
    inputs: Mapping[str, np.ndarray] = field(default_factory=dict)
    dtypes: Mapping[str, str] = field(default_factory=dict)
    announced: bool = False
    # Edits, entry stage: the input image file's bytes and where the client put it (errors name it).
    image: np.ndarray | None = None
    image_param: str = "image"
    # Masked edits, entry stage: the mask file's bytes (``media[1]``).
    mask: np.ndarray | None = None
    conditioning: Conditioning | None = None
    ready_at: float = 0.0


class DiffusersImageEngine(WorkerEngine[_Job]):
    """``diffusers`` adapter for ``text-to-image`` and its three split tasks."""

    def __init__(self, context: EngineContext) -> None:
        super().__init__(context)
        args = dict(context.stage.engine_args)
        self.role = ROLES[context.stage.task]
        self._edits = context.stage.task in EDIT_TASKS
        self._device = resolve_device(context.settings.device)
        dtype = torch_dtype(args.get("dtype"), self._device)
        # diffusers has no "auto" dtype; bf16 is what DiT checkpoints ship in and run best at.
        self._dtype = torch.bfloat16 if dtype == "auto" else dtype
        self._max_batch = int(args.get("max_batch_size", DEFAULT_MAX_BATCH))
        self._batch_wait = float(args.get("batch_wait", DEFAULT_BATCH_WAIT))
        self._cfg_batch = flag(args, "cfg_batch", default=False)
        self._fuse_blocks = flag(args, "fuse_blocks", default=False)
        self._announced = Announcements()
        self._pipe: Any = None
        # Masked edits: the family's inpainting pipeline on the same components (None where not served).
        self._inpaint: Any = None
        self._family: Family | None = None
        self._defaults: PipelineDefaults | None = None
        self._ready: list[_Job] = []

    @property
    def components(self) -> tuple[str, ...]:
        """The pipeline components this stage loaded (the others are ``None``)."""
        pipe = self._pipe
        if pipe is None:
            return ()
        return tuple(sorted(name for name in pipe.components if getattr(pipe, name, None) is not None))

    @property
    def defaults(self) -> PipelineDefaults:
        """The model's defaults and size rule (available once started)."""
        if self._defaults is None:
            raise StageError("the engine is not running", status=503, type="service_unavailable")
        return self._defaults

    # ------------------------------------------------------------------ event loop side

    async def warmup(self) -> None:
        """One smallest-size, two-step request through the role's whole code path (kernels, allocator)."""
        side = self.defaults.multiple
        # Two steps: with a terminal shift (Qwen-Image's scheduler) a one-step schedule divides by zero.
        image = TextToImageParams(width=side, height=side, num_inference_steps=2, seed=0)
        edit = ImageEditParams(source_width=side, source_height=side) if self._edits else None
        media: tuple[MediaInput, ...] = ()
        given: dict[str, np.ndarray] = {}
        if self._edits and self.role in (Role.WHOLE, Role.ENCODE):
            media = (MediaInput(kind="image", tensor="image", format="image/png", param="image"),)
            given = {"image": await asyncio.to_thread(_blank_png, side)}
        request = StageRequest(
            request_id=f"warmup-{secrets.token_hex(4)}",
            prompt="Warm up.",
            media=media,
            params=StageParams(image=image, edit=edit),
        )
        upstream: AsyncIterator[Any] | None = None
        if self.role in (Role.DENOISE, Role.DECODE):
            tensors = await asyncio.to_thread(self._dummy_inputs, side)
            upstream = _frames(TensorFrame(tensors=tensors[0], meta={"dtypes": tensors[1]}), FinalFrame("stop"))
        async for _ in self.generate(StageInput(request=request, tensors=given, upstream=upstream)):
            pass

    def queue_depth(self) -> int:
        return super().queue_depth() + len(self._ready)

    @property
    def announced(self) -> int:
        """Requests whose ``generate()`` has started but whose inputs have not reached the worker yet."""
        return self._announced.total()

    async def generate(self, inp: StageInput) -> AsyncIterator[ResponseFrame]:
        self.require_running()
        request = inp.request
        params = resolve(request, self.defaults)
        if self.role in (Role.WHOLE, Role.ENCODE) and not (request.prompt or "").strip():
            raise StageError("prompt must not be empty", status=400, param="prompt")
        job = _Job(request=request, params=params)
        if self._edits and self.role in (Role.WHOLE, Role.ENCODE):
            job.image, job.image_param, job.mask = _input_files(inp, params.masked)
        batched = self.role in (Role.WHOLE, Role.DENOISE)
        if batched:
            self._announced.add(params.key)
            job.announced = True
        queued = False
        try:
            if self.role in (Role.DENOISE, Role.DECODE):
                if inp.upstream is None:
                    raise StageError(f"the {self.role} stage needs an upstream stage", status=500)
                job.inputs, job.dtypes = await upstream_tensors(inp.upstream, self.role)
            self.submit(job)
            queued = True
            async with contextlib.aclosing(self.relay(job)) as frames:
                async for frame in frames:
                    yield frame
        finally:
            job.cancelled = True
            if batched and not queued:
                # Never reached the worker (the client left, the upstream failed): withdraw the
                # announcement and wake a batch that may be waiting for it.
                self._announced.remove(params.key)
                self.wake()

    # ------------------------------------------------------------------ worker thread

    def worker_mode(self) -> contextlib.AbstractContextManager[Any]:
        return torch.inference_mode()

    def load(self) -> None:
        # Progress bars are noise in pod logs.
        diffusers_logging.disable_progress_bar()
        hf_logging.disable_progress_bar()
        model_dir = self.context.model_dir
        family, index = family_for(model_dir)
        if family.edits != self._edits:
            does = "edits an input image" if family.edits else "generates images from text"
            raise ValueError(
                f"{model_dir} holds a {family.pipeline_class}, which {does}: not a {self.stage.task} model"
            )
        names = [k for k, v in index.items() if not k.startswith("_") and isinstance(v, list)]
        keep = family.components(names, str(self.role))
        skipped = {name: None for name in names if name not in keep}
        with LOAD_LOCK:
            given = family.load_overrides(model_dir, keep)
            pipe = DiffusionPipeline.from_pretrained(model_dir, dtype=self._dtype, **skipped, **given)
            pipe.to(self._device)
        pipe.set_progress_bar_config(disable=True)
        family.configure(pipe, model_dir)
        if self._cfg_batch and self.role in (Role.WHOLE, Role.DENOISE) and not family.batches_guidance:
            raise ValueError(
                "engine_args.cfg_batch is implemented for QwenImagePipeline and QwenImageEditPipeline, "
                f"not {family.pipeline_class}"
            )
        self._speed_up(pipe)
        if flag(self.context.stage.engine_args, "vae_2d", default=False) and getattr(pipe, "vae", None) is not None:
            from omnimodel_runtime.engines.t2i.vae import vae_2d  # noqa: PLC0415

            log.info("VAE of stage %s: %d causal 3D convolutions as 2D on one frame", self.stage.name, vae_2d(pipe.vae))
        if family.inpaints and self.role is not Role.DECODE:
            self._inpaint = family.inpaint_pipeline(pipe, model_dir)
        self._pipe, self._family = pipe, family
        self._defaults = family.defaults(type(pipe), model_dir)
        log.info(
            "Loaded %s (%s) from %s on %s (%s) for stage %s",
            type(pipe).__name__,
            ", ".join(sorted(keep)),
            model_dir,
            self._device,
            self._dtype,
            self.stage.name,
        )

    def _speed_up(self, pipe: Any) -> None:
        """The ``compile``, ``cache``, ``attention`` and ``fuse_blocks`` engine arguments on the loaded
        transformer."""
        speed_up(pipe, self.context.stage)

    def _dummy_inputs(self, side: int) -> tuple[dict[str, np.ndarray], dict[str, str]]:
        assert self._family is not None
        if self.role is Role.DENOISE:
            condition = self.defaults.condition_size(side, side) if self.defaults.condition_size else None
            return to_wire(self._family.dummy_conditioning(self._pipe, condition).tensors)
        return to_wire({LATENTS: self._family.dummy_latents(self._pipe, side, side)})

    def serve(self) -> None:
        while True:
            self.flush()
            if self.stopping:
                for held in self._ready:
                    self.refuse(held)
                self._ready.clear()
                return
            if not self._ready:
                if (job := self.take()) is not None:
                    self._accept(job)
                continue
            # Everything already queued joins the choice of the next batch.
            while (job := self.take(0)) is not None:
                self._accept(job)
            self._drop_dead()
            if not self._ready:
                continue
            batch = self._select()
            first = batch[0]
            room = self._max_batch - sum(j.params.n for j in batch)
            remaining = first.ready_at + self._batch_wait - time.monotonic()
            if room > 0 and remaining > 0 and self._announced.pending(first.params.key) > 0:
                self.flush()
                if (late := self.take(remaining)) is not None:
                    self._accept(late)
                continue
            self._run_batch(batch)

    def _accept(self, job: _Job) -> None:
        """Take one job from the inbox: encode and decode run at once, denoise (and whole) wait in
        ``_ready`` for the choice of a batch."""
        if job.announced:
            self._announced.remove(job.params.key)
        if job.cancelled:
            return
        try:
            if self.role is Role.ENCODE:
                self._encode(job)
            elif self.role is Role.DECODE:
                self._decode(job)
            else:
                job.conditioning = (
                    self._encode_conditioning(job) if self.role is Role.WHOLE else self._conditioning(job)
                )
                job.ready_at = time.monotonic()
                self._ready.append(job)
        except Exception as err:
            self.fail(job, err)

    def _drop_dead(self) -> None:
        alive = []
        for job in self._ready:
            if not job.cancelled and not self.drop_if_expired(job):
                alive.append(job)
        self._ready = alive

    def _select(self) -> list[_Job]:
        """The oldest ready request and, in arrival order, compatible ones that fit beside it."""
        first = self._ready[0]
        batch, images = [first], first.params.n
        for job in self._ready[1:]:
            if job.params.key == first.params.key and images + job.params.n <= self._max_batch:
                batch.append(job)
                images += job.params.n
        return batch

    # ------------------------------------------------------------------ the stages' work

    def _encode_conditioning(self, job: _Job) -> Conditioning:
        assert self._family is not None
        assert self._defaults is not None
        image = None
        if job.image is not None:
            image = decode_image(job.image, job.image_param)
            if image.size != job.params.source:
                raise StageError(
                    f"{job.image_param}: the image is {image.size[0]}x{image.size[1]} pixels, but the request "
                    f"says {job.params.source}",
                    status=400,
                    param=job.image_param,
                )
        prompt, negative, length = (
            job.request.prompt or "",
            job.params.negative_prompt,
            self._defaults.max_sequence_length,
        )
        if job.mask is not None and image is not None:
            if self._inpaint is None:
                raise StageError("this model serves no masked edits", status=400, param="mask")
            mask = decode_mask(job.mask, "mask", image.size)
            # The generators of the request's images, as for an unmasked edit's noise: the inpainting
            # pipeline draws its VAE sample from the first one, here, and denoise continues them.
            generators = [torch.Generator("cpu").manual_seed(s) for s in job.params.seeds()]
            return self._family.encode_masked(self._inpaint, prompt, negative, length, image, mask, generators)
        encode = self._family.encode_together if self._cfg_batch else self._family.encode
        return encode(self._pipe, prompt, negative, length, image)

    def _encode(self, job: _Job) -> None:
        conditioning = self._encode_conditioning(job)
        tensors, dtypes = to_wire(conditioning.tensors)
        self.emit(job, TensorFrame(tensors=tensors, meta={"dtypes": dtypes}))
        self.emit(job, FinalFrame("stop", Usage(prompt_tokens=conditioning.prompt_tokens)))

    def _conditioning(self, job: _Job) -> Conditioning:
        tensors = from_wire(job.inputs, job.dtypes, self._device)
        if "prompt_embeds" not in tensors:
            raise StageError("the upstream stage sent no prompt_embeds", status=502)
        if job.params.cfg and "negative_prompt_embeds" not in tensors:
            raise StageError("guidance is on but the upstream stage sent no negative_prompt_embeds", status=502)
        if self._edits and IMAGE_LATENTS not in tensors:
            raise StageError(f"the upstream stage sent no {IMAGE_LATENTS} for the edit", status=502)
        if job.params.masked:
            if MASK_CONDITION not in tensors or GENERATOR_STATES not in tensors:
                raise StageError(f"the upstream stage sent no {MASK_CONDITION} for the masked edit", status=502)
            if tensors[GENERATOR_STATES].shape[0] != job.params.n:
                raise StageError(f"the upstream stage sent generators for another n than {job.params.n}", status=502)
        return Conditioning(tensors=tensors, prompt_tokens=0)

    def _run_batch(self, batch: list[_Job]) -> None:
        assert self._family is not None
        done = {id(j) for j in batch}
        self._ready = [j for j in self._ready if id(j) not in done]
        params = batch[0].params
        self.context.metrics.observe_batch(len(batch))
        try:
            latents = self._denoise(batch, params)
        except Exception as err:
            for job in batch:
                self.fail(job, err)
            return
        if self.stopping:  # the denoise loop was cut short: its latents are no image
            for job in batch:
                self.refuse(job)
            return
        offset = 0
        for job in batch:
            rows = latents[offset : offset + job.params.n]
            offset += job.params.n
            if job.cancelled:
                continue
            try:
                if self.role is Role.DENOISE:
                    tensors, dtypes = to_wire({LATENTS: rows})
                    self.emit(job, TensorFrame(tensors=tensors, meta={"dtypes": dtypes}))
                    self.emit(job, FinalFrame("stop"))
                else:
                    self._emit_images(job, self._family.decode(self._pipe, rows, params.height, params.width))
                    self.flush()
            except Exception as err:
                self.fail(job, err)

    def _denoise(self, batch: list[_Job], params: Resolved) -> torch.Tensor:
        assert self._family is not None
        items = [(j.conditioning, j.params.n) for j in batch if j.conditioning is not None]
        # A masked edit runs the inpainting pipeline's loop (its strength, its latent blending each step).
        pipe = self._inpaint if params.masked else self._pipe
        if pipe is None:
            raise StageError("this model serves no masked edits", status=400, param="mask")
        kwargs, inputs = self._family.denoise_inputs(
            pipe, items, params.source, params.strength if params.masked else None
        )
        # Per-image CPU generators: the same seed gives the same initial noise alone or in a batch, and
        # on any device (diffusers draws on the CPU and moves the noise). A masked edit's come from encode,
        # past the VAE sample the inpainting pipeline draws first.
        generators = (
            [g for j in batch if j.conditioning for g in restore_generators(j.conditioning.tensors[GENERATOR_STATES])]
            if params.masked
            else [torch.Generator("cpu").manual_seed(s) for j in batch for s in j.params.seeds()]
        )

        def step_end(pipe: Any, step: int, timestep: Any, tensors: dict[str, Any]) -> dict[str, Any]:
            # Nobody is waiting for any image of this batch any more: skip the remaining steps.
            if self.stopping or all(j.cancelled or j.expired for j in batch):
                pipe._interrupt = True
            return {}

        guidance: contextlib.AbstractContextManager[Any] = (
            BatchedGuidance(self._pipe, self._family.merge_guidance)
            if self._cfg_batch and params.cfg
            else contextlib.nullcontext()
        )
        schedule: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if self._fuse_blocks:
            from omnimodel_runtime.engines.t2i.fused import ModulationSchedule  # noqa: PLC0415

            schedule = ModulationSchedule(pipe)
        with guidance, schedule, inputs:
            result = pipe(
                **kwargs,
                **self._family.guidance_kwargs(
                    cfg=params.cfg, true_cfg_scale=params.true_cfg_scale, guidance_scale=params.guidance_scale
                ),
                height=params.height,
                width=params.width,
                num_inference_steps=params.steps,
                generator=generators,
                output_type="latent",
                callback_on_step_end=step_end,
            )
        for job in batch:
            if not job.cancelled and self.drop_if_expired(job):
                job.cancelled = True
        latents: torch.Tensor = result.images
        return latents

    def _decode(self, job: _Job) -> None:
        assert self._family is not None
        latents = from_wire(job.inputs, job.dtypes, self._device).get(LATENTS)
        if latents is None:
            raise StageError("the upstream stage sent no latents", status=502)
        if latents.shape[0] != job.params.n:
            raise StageError(f"the upstream stage sent {latents.shape[0]} latents for n={job.params.n}", status=502)
        self._emit_images(job, self._family.decode(self._pipe, latents, job.params.height, job.params.width))

    def _emit_images(self, job: _Job, images: np.ndarray) -> None:
        self.emit(job, TensorFrame(tensors={IMAGES_TENSOR: images}, meta={"modality": "image"}))
        self.emit(
            job, FinalFrame("stop", Usage(prompt_tokens=job.conditioning.prompt_tokens if job.conditioning else 0))
        )


def _input_files(inp: StageInput, masked: bool) -> tuple[np.ndarray, str, np.ndarray | None]:
    """The bytes of an edit's one input image (``media[0]``), its ``param``, and with ``masked`` its mask's
    (``media[1]``); a 400 when one is missing or extra."""
    media = inp.request.media
    expected = 2 if masked else 1
    if len(media) != expected or any(m.kind != "image" for m in media):
        # Name what is missing (the image, then the mask) or the first file too many.
        param = media[expected].param if len(media) > expected else ("mask" if media else "image")
        raise StageError(
            "an edit takes exactly one input image" + (" and one mask" if masked else ""), status=400, param=param
        )
    files = []
    for item in media:
        data = inp.tensors.get(item.tensor)
        if data is None:
            raise StageError(f"{item.param}: its bytes did not arrive with the request", status=400, param=item.param)
        files.append(data)
    return files[0], media[0].param, files[1] if masked else None


def _blank_png(side: int) -> np.ndarray:
    """A grey ``side`` x ``side`` PNG file (the warm-up's input image)."""
    import io  # noqa: PLC0415

    from PIL import Image  # noqa: PLC0415

    buffer = io.BytesIO()
    Image.new("RGB", (side, side), (128, 128, 128)).save(buffer, format="PNG")
    return np.frombuffer(buffer.getvalue(), dtype=np.uint8)


async def _frames(*frames: ResponseFrame) -> AsyncIterator[ResponseFrame]:
    for frame in frames:
        yield frame
