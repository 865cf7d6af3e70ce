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
