"""Opening and decoding image files: the one place PIL reads a dataset's images.

:func:`open_image` opens a file lazily (its header only) under the project's pixel limit, so an
oversized image (a decompression bomb) is an ``OSError`` naming its size, the limit and how to
raise it, never a bare ``PIL.Image.DecompressionBombError``. :func:`load_rgb` decodes the whole
file to 8-bit RGB; a truncated or corrupt file is an ``OSError``. 16-bit images (PNG mode
``I;16``) are scaled to 8 bits, not clipped (clipping turns them almost all white).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, BinaryIO

from dflop_ds.data.errors import PathArg

#: Environment variable holding the largest image, in pixels, that is decoded (0: no limit).
MAX_PIXELS_ENV = "DFLOP_DS_MAX_IMAGE_PIXELS"
#: The default: PIL's own decompression-bomb error threshold (2 x ``Image.MAX_IMAGE_PIXELS``).
DEFAULT_MAX_PIXELS = 2 * 89_478_485
#: Modes whose pixels are 16-bit integers (``I`` is how some PIL versions open 16-bit PNGs).
WIDE_INTEGER_MODES = frozenset({"I;16", "I;16L", "I;16B", "I;16N", "I"})


class ImageTooLarge(OSError):
    """An image over the pixel limit (:data:`MAX_PIXELS_ENV`); the message says how to raise it."""


def max_image_pixels() -> int | None:
    """The pixel limit from :data:`MAX_PIXELS_ENV` (default :data:`DEFAULT_MAX_PIXELS`; None: no limit).

    Raises:
        ValueError: the variable is not a non-negative integer.
    """
    text = os.environ.get(MAX_PIXELS_ENV, "").strip()
    if not text:
        return DEFAULT_MAX_PIXELS
    try:
        limit = int(text)
    except ValueError:
        limit = -1
    if limit < 0:
        raise ValueError(f"{MAX_PIXELS_ENV}={text!r}: expected a pixel count (an integer >= 0; 0 means no limit)")
    return limit or None


@contextmanager
def open_image(path: PathArg | BinaryIO) -> Iterator[Any]:
    """The image at ``path`` (or in a file object) opened by PIL (header read, pixels not yet decoded), closed on exit.

    Raises:
        ImageTooLarge: it has more pixels than :func:`max_image_pixels` allows.
        OSError: PIL cannot open or identify it.
    """
    from PIL import Image

    limit = max_image_pixels()
    saved = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = None  # the check below replaces PIL's bare error and warning
    try:
        image = Image.open(path)
    finally:
        Image.MAX_IMAGE_PIXELS = saved
    with image:
        width, height = image.size
        if limit is not None and width * height > limit:
            raise ImageTooLarge(
                f"image {path} is {width}x{height} = {width * height} pixels, over the limit of {limit} pixels "
                f"that guards against decompression bombs; to read it, set the environment variable "
                f"{MAX_PIXELS_ENV} to a larger pixel count (0: no limit)"
            )
        yield image


def to_rgb(image: Any) -> Any:
    """``image`` as 8-bit RGB, decoding it; 16-bit integer pixels are scaled (65535 -> 255), not clipped."""
    if image.mode in WIDE_INTEGER_MODES:
        import numpy as np
        from PIL import Image

        pixels = np.asarray(image).astype(np.float64) / 257.0
        gray = Image.fromarray(np.clip(np.rint(pixels), 0, 255).astype(np.uint8), "L")
        return gray.convert("RGB")
    return image.convert("RGB")


def load_rgb(path: PathArg) -> Any:
    """The image at ``path`` fully decoded as 8-bit RGB (:func:`to_rgb`).

    Raises:
        OSError: it cannot be opened, is over the pixel limit, or is truncated or corrupt.
    """
    with open_image(path) as image:
        try:
            return to_rgb(image)
        except (SyntaxError, ValueError) as exc:  # PIL reports some corrupt streams this way
            raise OSError(f"cannot decode image {path}: {exc}") from exc


__all__ = ["DEFAULT_MAX_PIXELS", "MAX_PIXELS_ENV", "ImageTooLarge", "load_rgb", "max_image_pixels", "open_image"]
