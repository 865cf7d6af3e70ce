"""Image files a request brings (chat image parts, the input of an image edit), decoded by Pillow."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from omnimodel_runtime.errors import StageError


def decode_image(data: np.ndarray, param: str) -> Any:
    """An RGB ``PIL.Image`` from the bytes of an image file; a file Pillow cannot read is a 400 naming
    ``param`` (where the client put it)."""
    try:
        with Image.open(io.BytesIO(data.tobytes())) as img:
            img.load()
            return img.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as err:
        raise StageError(f"{param}: cannot decode the image: {err}", status=400, param=param) from err


def decode_mask(data: np.ndarray, param: str, size: tuple[int, int]) -> Any:
    """OpenAI's edit mask → diffusers' inpainting mask.

    OpenAI: a PNG of the image's size whose fully transparent pixels (alpha 0) are where to edit; every
    other pixel, partly transparent ones included, is kept. diffusers (``mask_image``): white pixels are
    repainted, black ones kept. So the result is a ``PIL`` ``L`` image, 255 where alpha is 0, else 0.
    A file that is not a PNG, has no transparency, or has another size is a 400 naming ``param``."""
    try:
        with Image.open(io.BytesIO(data.tobytes())) as img:
            img.load()
            if img.format != "PNG":
                raise StageError(f"{param}: must be a PNG file (got {img.format})", status=400, param=param)
            if "A" not in img.getbands() and "transparency" not in img.info:
                raise StageError(f"{param}: the PNG has no alpha channel", status=400, param=param)
            if img.size != size:
                raise StageError(
                    f"{param}: the mask is {img.size[0]}x{img.size[1]} pixels but the image is {size[0]}x{size[1]}",
                    status=400,
                    param=param,
                )
            alpha = np.asarray(img.convert("RGBA"))[:, :, 3]
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as err:
        raise StageError(f"{param}: cannot decode the image: {err}", status=400, param=param) from err
    return Image.fromarray(np.where(alpha == 0, 255, 0).astype(np.uint8), mode="L")
