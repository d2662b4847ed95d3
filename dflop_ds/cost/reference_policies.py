"""The shape policy each analytic reference model (:func:`~dflop_ds.cost.reference_model`) is paired with.

A reference model predicts from encoder units and LLM tokens; which units a sample gives is its
model's image processing, so each reference model comes with the policy that counts them. Like
:data:`~dflop_ds.shapes.DEFAULT_POLICY` (LLaVA-OneVision's AnyRes tiling), these follow the
models' published processing with a stated approximation each; a HuggingFace model directory's
own policy (``--model-name-or-path``) counts exactly.

- ``llava-ov-*``: :data:`~dflop_ds.shapes.DEFAULT_POLICY`.
- ``qwen2-vl-2b``: native resolution (Qwen2-VL's ``preprocessor_config.json``: patch 14, merge 2,
  ``min_pixels`` 3136, ``max_pixels`` 12845056): an image is resized to multiples of 28 px keeping
  its aspect ratio within the pixel bounds (:class:`NativeResolution`); one encoder unit is one LLM
  token's 2x2 patches (the reference model runs 4 encoder tokens per unit). Videos: 32 sampled
  frames at 448x448 px (an assumption: the mixture records no frame size or rate), 2 frames per
  temporal patch, so 128 units and 128 LLM tokens per frame. The encoder's attention across a
  whole image is not counted (about a seventh of the tower's FLOPs on a 640x480 image).
- ``internvl2.5-26b``: 448 px tiles, at most 12 per image plus a thumbnail when there are more
  than one (``max_dynamic_patch`` 12, ``use_thumbnail``), 256 LLM tokens per tile (pixel shuffle
  0.5 of 32x32 patches); videos 32 frames of one tile each. The grid is chosen by the AnyRes rule
  of :class:`~dflop_ds.shapes.ShapePolicy` rather than InternVL's closest aspect ratio.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dflop_ds.shapes import DEFAULT_POLICY, ShapePolicy


@dataclass(frozen=True)
class NativeResolution:
    """Qwen2-VL's image size rule without its processor: ``(width, height) -> (units, LLM tokens)``,
    one unit per LLM token (``merge x merge`` patches of ``patch`` px), the image resized to whole
    units keeping its aspect ratio and its area within ``min_pixels``..``max_pixels``."""

    patch: int
    merge: int
    min_pixels: int
    max_pixels: int

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """``(rows, cols)`` of units after resizing: each side rounded to whole units, scaled down
        (rounding down) above ``max_pixels`` or up (rounding up) below ``min_pixels``."""
        unit = self.patch * self.merge
        rows, cols = max(1, round(height / unit)), max(1, round(width / unit))
        area = rows * cols * unit * unit
        if area > self.max_pixels:
            scale = math.sqrt(height * width / self.max_pixels)
            rows, cols = max(1, math.floor(height / scale / unit)), max(1, math.floor(width / scale / unit))
        elif area < self.min_pixels:
            scale = math.sqrt(self.min_pixels / (height * width))
            rows, cols = math.ceil(height * scale / unit), math.ceil(width * scale / unit)
        return rows, cols

    def __call__(self, width: int, height: int) -> tuple[int, int]:
        rows, cols = self.grid(width, height)
        return rows * cols, rows * cols


QWEN2_VL_POLICY = ShapePolicy(
    tile_size=28,
    max_tiles=1,
    add_thumbnail=False,
    tokens_per_tile=1,
    max_frames=32,
    tokens_per_frame=128,
    units_per_frame=128,
    name="qwen2-vl-2b",
    image_rule=NativeResolution(patch=14, merge=2, min_pixels=3136, max_pixels=12845056),
)
INTERNVL2_5_POLICY = ShapePolicy(
    tile_size=448,
    max_tiles=12,
    add_thumbnail=True,
    tokens_per_tile=256,
    max_frames=32,
    tokens_per_frame=256,
    name="internvl2.5-26b",
)
#: the policy of each reference model, by its name without the GPU
REFERENCE_POLICIES = {
    "llava-ov-0.5b": DEFAULT_POLICY,
    "llava-ov-7b": DEFAULT_POLICY,
    "llava-ov-72b": DEFAULT_POLICY,
    "qwen2-vl-2b": QWEN2_VL_POLICY,
    "internvl2.5-26b": INTERNVL2_5_POLICY,
}


def reference_policy(name: str) -> ShapePolicy:
    """The shape policy of reference model ``name`` (``<model>-<gpu>``, or the model alone)."""
    key = name.lower()
    if key not in REFERENCE_POLICIES:
        key = key.rpartition("-")[0]
    if key not in REFERENCE_POLICIES:
        raise KeyError(f"unknown reference model {name!r}; known: {', '.join(REFERENCE_POLICIES)}")
    return REFERENCE_POLICIES[key]
