"""What a text-to-image request asks of a stage (its role's task, its parameters resolved against the
model) and the bookkeeping that lets requests with the same shape share one denoise call."""

from __future__ import annotations

import enum
import secrets
import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from omnimodel_runtime.engines.t2i.family import PipelineDefaults
from omnimodel_runtime.errors import StageError
from omnimodel_runtime.protocol.stage import StageRequest


class Role(enum.StrEnum):
    WHOLE = "whole"
    ENCODE = "encode"
    DENOISE = "denoise"
    DECODE = "decode"


ROLES: Final[Mapping[str, Role]] = {
    "text-to-image": Role.WHOLE,
    "t2i-encode": Role.ENCODE,
    "t2i-denoise": Role.DENOISE,
    "t2i-decode": Role.DECODE,
    "image-edit": Role.WHOLE,
    "image-edit-encode": Role.ENCODE,
    "image-edit-denoise": Role.DENOISE,
    "image-edit-decode": Role.DECODE,
}
# The tasks whose pipeline edits an input image (the others generate from text alone).
EDIT_TASKS: Final = frozenset(task for task in ROLES if task.startswith("image-edit"))


@dataclass(frozen=True)
class Resolved:
    """A request's parameters with every default filled in and checked against the model."""

    n: int
    width: int
    height: int
    steps: int
    cfg: bool
    true_cfg_scale: float
    guidance_scale: float | None
    negative_prompt: str | None
    seed: int | None
    # Edits: the input image's size and the size the pipeline encodes it at (None for text to image).
    source: tuple[int, int] | None = None
    condition: tuple[int, int] | None = None
    # Masked edits (QwenImageEditInpaintPipeline): a mask came with the image, and its strength.
    masked: bool = False
    strength: float = 1.0

    @property
    def key(self) -> tuple[Any, ...]:
        """Requests with equal keys can share one denoise call."""
        return (
            self.condition,
            self.width,
            self.height,
            self.steps,
            self.cfg,
            self.true_cfg_scale if self.cfg else None,
            self.guidance_scale,
            # Masked and plain edits run different pipelines; masked ones share a call only at one strength.
            self.masked,
            self.strength,
        )

    def seeds(self) -> list[int]:
        base = self.seed if self.seed is not None else secrets.randbits(62)
        return [base + i for i in range(self.n)]


def resolve(request: StageRequest, defaults: PipelineDefaults) -> Resolved:
    """Fill ``request.params.image`` from the model's defaults and check it against the model (its size
    rule); a bad value is a 400 naming the field. The parameters' own bounds were checked when the
    request was built (or decoded from the wire)."""
    params = request.params.image
    default_width, default_height = defaults.width, defaults.height
    edit, source, condition = request.params.edit, None, None
    if defaults.condition_size is not None:
        if edit is None:
            raise StageError("this model edits an image: the request needs one (image)", status=400, param="image")
        source = (edit.source_width, edit.source_height)
        condition = defaults.condition_size(*source)
        # The pipeline's own default: the condition's size, down to the size rule.
        default_width, default_height = (side // defaults.multiple * defaults.multiple for side in condition)
    elif edit is not None:
        raise StageError("this model generates images from text; it takes no input image", status=400, param="image")
    width = params.width if params.width is not None else default_width
    height = params.height if params.height is not None else default_height
    masked = edit is not None and edit.mask
    if masked and (width, height) != (default_width, default_height):
        # QwenImageEditInpaintPipeline.__call__ always works at the condition's size (it overrides height
        # and width), so another size is refused rather than silently not given.
        raise StageError(
            f"size: a masked edit's output has the pipeline's size for this input, "
            f"{default_width}x{default_height} (send that, auto or no size; got {width}x{height})",
            status=400,
            param="size",
        )
    if width % defaults.multiple or height % defaults.multiple:
        raise StageError(
            f"size must be a multiple of {defaults.multiple} pixels in each dimension for this model "
            f"(got {width}x{height})",
            status=400,
            param="size",
        )
    true_cfg = params.true_cfg_scale if params.true_cfg_scale is not None else defaults.true_cfg_scale
    # The pipeline's own rule: real classifier-free guidance needs a negative prompt and a scale above 1.
    cfg = params.negative_prompt is not None and true_cfg > 1
    steps = params.num_inference_steps or defaults.steps
    if steps < defaults.min_steps:
        raise StageError(
            f"num_inference_steps must be at least {defaults.min_steps} for this model's scheduler (got {steps})",
            status=400,
            param="num_inference_steps",
        )
    strength = edit.strength if edit is not None else 1.0
    if masked and steps - int(max(steps - steps * strength, 0)) < 1:
        # The pipeline's get_timesteps: strength keeps the last steps * strength steps of the schedule.
        raise StageError(
            f"strength {strength} leaves no denoising step of {steps}; raise strength or num_inference_steps",
            status=400,
            param="strength",
        )
    guidance = None
    if defaults.guidance_distilled:
        guidance = params.guidance_scale if params.guidance_scale is not None else defaults.guidance_scale
    return Resolved(
        n=params.n,
        width=width,
        height=height,
        steps=steps,
        cfg=cfg,
        true_cfg_scale=true_cfg,
        guidance_scale=guidance,
        negative_prompt=params.negative_prompt if cfg else None,
        seed=params.seed,
        source=source,
        condition=condition,
        masked=masked,
        strength=strength,
    )


class Announcements:
    """Requests announced to the batcher and not yet accepted by the worker, per batch key."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[tuple[Any, ...]] = Counter()

    def add(self, key: tuple[Any, ...]) -> None:
        with self._lock:
            self._counts[key] += 1

    def remove(self, key: tuple[Any, ...]) -> None:
        with self._lock:
            self._counts[key] -= 1
            if self._counts[key] <= 0:
                del self._counts[key]

    def pending(self, key: tuple[Any, ...]) -> int:
        with self._lock:
            return self._counts.get(key, 0)

    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())
