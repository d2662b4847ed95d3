"""InternVL's tiles and tokens per image and per video, counted as its image processor
(``GotOcr2ImageProcessor``, ``crop_to_patches``) and processor count them.

An image is cut into the ``cols x rows`` grid of ``min_tiles..max_tiles`` tiles whose aspect ratio
is closest to its own (on a tie, the grid with more tiles while the image covers more than half of
its area), plus a thumbnail tile when the grid has more than one tile. Every tile gives
``tokens_per_tile`` tokens (the tower's patches after the pixel shuffle). A video's frames are one
tile each. These are pure functions of sizes; :class:`InternVLTileRule` holds a checkpoint's numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: the most tiles per image :class:`InternVLTileRule` takes (its grid search is quadratic in them)
MAX_TILES = 256


@dataclass(frozen=True)
class InternVLTileRule:
    """A checkpoint's tiling numbers: ``tile_size`` px tiles, ``min_tiles``..``max_tiles`` per image
    (``max_tiles`` 1: no tiling), ``tokens_per_tile`` LLM tokens per tile."""

    tile_size: int
    min_tiles: int
    max_tiles: int
    tokens_per_tile: int

    def __post_init__(self) -> None:
        """Refuse sizes the tiling cannot use, naming the checkpoint's keys."""
        counts = {"image_size": self.tile_size, "min_patches": self.min_tiles, "max_patches": self.max_tiles}
        counts["tokens per tile"] = self.tokens_per_tile
        for key, value in counts.items():
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{key} must be a whole number, got {value!r}")
        if self.tile_size < 1 or self.tokens_per_tile < 1:
            raise ValueError(f"tile size {self.tile_size} and tokens per tile {self.tokens_per_tile} must be positive")
        if not 1 <= self.min_tiles <= self.max_tiles <= MAX_TILES:
            raise ValueError(
                f"min_patches {self.min_tiles} and max_patches {self.max_tiles}: need 1 <= min_patches <= max_patches"
                f" <= {MAX_TILES} (a grid search over max_patches^2 layouts per image; InternVL uses up to 40)"
            )

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """The ``(cols, rows)`` grid an image of ``width x height`` is cut into."""
        if width <= 0 or height <= 0:
            raise ValueError(f"image size must be positive, got {width}x{height}")
        grids = sorted(
            (
                (cols, rows)
                for cols in range(1, self.max_tiles + 1)
                for rows in range(1, self.max_tiles + 1)
                if self.min_tiles <= cols * rows <= self.max_tiles
            ),
            key=lambda grid: grid[0] * grid[1],
        )
        aspect, area = width / height, width * height
        best, best_diff = (1, 1), float("inf")
        for cols, rows in grids:
            diff = abs(aspect - cols / rows)
            if diff < best_diff:
                best, best_diff = (cols, rows), diff
            elif diff == best_diff and area > 0.5 * self.tile_size * self.tile_size * cols * rows:
                best = (cols, rows)
        return best

    def image(self, width: int, height: int) -> tuple[int, int]:
        """``(tiles, tokens)`` of one image: its grid's tiles plus the thumbnail, or one tile."""
        if self.max_tiles <= 1:
            tiles = 1
        else:
            cols, rows = self.grid(width, height)
            tiles = 1 if cols * rows == 1 else cols * rows + 1
        return tiles, tiles * self.tokens_per_tile

    def __call__(self, sizes: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """``(tiles, tokens)`` of each image of one sample (a :data:`~dflop_ds.shapes.SampleImagesRule`:
        InternVL tiles every image alike)."""
        return [self.image(width, height) for width, height in sizes]

    def video(self, frames: int) -> tuple[int, int]:
        """``(tiles, tokens)`` of a video of ``frames`` sampled frames."""
        return max(frames, 0), max(frames, 0) * self.tokens_per_tile


__all__ = ["InternVLTileRule"]
