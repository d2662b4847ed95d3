"""LLaVA-OneVision's tiles and tokens per image and per video, counted as its processor counts them.

A sample with one image is cut by AnyRes: the image is fitted onto the best grid of
``image_grid_pinpoints`` (most kept pixels, then least padding), cut into tiles of the tower's
``image_size`` and given a base tile (the whole image resized). The LLM sees the base tile's
features, then the grid's features with the padding rows or columns removed ("un-padding"), a
newline token closing each feature row, and, when the grid holds more than ``anyres_max_N`` tiles'
worth of features (by more than 10 %), the grid bilinearly pooled down to about that many. A sample
with several images gives each image its base tile only (padded to a square), plus one newline. A
video's frames are one tile each, their features pooled 2 x 2 (ceil), plus one newline for the video.

These are pure functions of sizes: :class:`OnevisionTokenRule` holds a checkpoint's numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def best_resolution(height: int, width: int, pinpoints: Sequence[Sequence[int]]) -> tuple[int, int]:
    """The ``(height, width)`` of ``pinpoints`` an image of ``height x width`` is fitted onto: the most
    pixels kept after downscaling (integer sizes), then the least canvas wasted, first one on ties."""
    best = (0, 0)
    most_kept, least_wasted = 0, math.inf
    for canvas_h, canvas_w in pinpoints:
        scale = min(canvas_w / width, canvas_h / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        wasted = canvas_w * canvas_h - kept
        if kept > most_kept or (kept == most_kept and wasted < least_wasted):
            best, most_kept, least_wasted = (int(canvas_h), int(canvas_w)), kept, wasted
    return best


def unpadded_grid(height: int, width: int, rows: int, cols: int) -> tuple[int, int]:
    """Feature rows and columns of a ``rows x cols`` feature grid left after removing the padding
    that fitting a ``height x width`` image onto it added (on both sides, equally)."""
    if width / height > cols / rows:
        new_rows = int(round(height * (cols / width), 7))
        rows -= (rows - new_rows) // 2 * 2
    else:
        new_cols = int(round(width * (rows / height), 7))
        cols -= (cols - new_cols) // 2 * 2
    return rows, cols


def check_onevision_settings(
    tile_size: int, patch_size: int, pinpoints: Sequence[Sequence[int]], max_tiles: int
) -> None:
    """Refuse, naming the checkpoint's key, settings the AnyRes counting cannot use: a tile smaller
    than a patch (``vision_config.image_size`` / ``patch_size``), no
    ``image_grid_pinpoints`` or a canvas that is not a positive multiple of the tile in both sides,
    and ``vision_aspect_ratio = "anyres_max_N"`` with ``N < 1``."""
    if patch_size < 1 or tile_size < patch_size:
        raise ValueError(
            f"vision_config.image_size {tile_size} and patch_size {patch_size}: a tile must hold at least one patch"
        )
    if not pinpoints:
        raise ValueError("image_grid_pinpoints is empty: give the (height, width) canvases images are fitted onto")
    for canvas in pinpoints:
        sides = canvas if isinstance(canvas, (list, tuple)) else ()
        whole = all(isinstance(side, int) and not isinstance(side, bool) for side in sides)
        if len(sides) != 2 or not whole or any(side < tile_size or side % tile_size for side in sides):
            raise ValueError(
                f"image_grid_pinpoints holds {list(sides) or canvas!r}: every canvas must be [height, width], each"
                f" a positive multiple of the tile size {tile_size}"
            )
    if max_tiles < 1:
        raise ValueError(f'vision_aspect_ratio "anyres_max_{max_tiles}": N must be at least 1')


@dataclass(frozen=True)
class OnevisionTokenRule:
    """A LLaVA-OneVision checkpoint's counting numbers.

    Attributes:
        tile_size: the tower's ``image_size`` in pixels (one tile).
        patch_size: the tower's patch size (a tile gives ``(tile_size // patch_size) ** 2`` features).
        pinpoints: ``image_grid_pinpoints`` as ``(height, width)`` canvases in pixels.
        max_tiles: ``N`` of ``vision_aspect_ratio = "anyres_max_N"``.
        drops_first_feature: ``vision_feature_select_strategy == "default"`` (the processor then
            writes one image token fewer per image).
    """

    tile_size: int
    patch_size: int
    pinpoints: tuple[tuple[int, int], ...]
    max_tiles: int = 9
    drops_first_feature: bool = False

    def __post_init__(self) -> None:
        check_onevision_settings(self.tile_size, self.patch_size, self.pinpoints, self.max_tiles)

    @property
    def side(self) -> int:
        """Features per tile side."""
        return self.tile_size // self.patch_size

    def image(self, width: int, height: int, *, alone: bool = True) -> tuple[int, int]:
        """``(tiles, tokens)`` of one image of ``width x height``: AnyRes when it is a sample's only
        image (``alone``), else its base tile and one newline."""
        if width <= 0 or height <= 0:
            raise ValueError(f"image size must be positive, got {width}x{height}")
        base = self.side**2
        drop = 1 if self.drops_first_feature else 0
        if not alone:
            return 1, base + 1 - drop
        canvas_h, canvas_w = best_resolution(height, width, self.pinpoints)
        grid_rows, grid_cols = canvas_h // self.tile_size, canvas_w // self.tile_size
        rows, cols = unpadded_grid(height, width, self.side * grid_rows, self.side * grid_cols)
        ratio = math.sqrt(rows * cols / (self.max_tiles * self.side**2))
        if ratio > 1.1:
            rows, cols = int(rows // ratio), int(cols // ratio)
        return 1 + grid_rows * grid_cols, base + rows * cols + rows - drop

    def images(self, sizes: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """``(tiles, tokens)`` of each image of one sample, sizes as ``(width, height)``."""
        alone = len(sizes) == 1
        return [self.image(width, height, alone=alone) for width, height in sizes]

    def __call__(self, sizes: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """:meth:`images` (the rule as a :data:`~dflop_ds.shapes.SampleImagesRule`)."""
        return self.images(sizes)

    def video(self, frames: int) -> tuple[int, int]:
        """``(tiles, tokens)`` of a video of ``frames`` sampled frames (0 frames: no video)."""
        if frames <= 0:
            return 0, 0
        pooled = math.ceil(self.side / 2)
        return frames, frames * pooled * pooled + 1


__all__ = ["OnevisionTokenRule", "best_resolution", "unpadded_grid"]
