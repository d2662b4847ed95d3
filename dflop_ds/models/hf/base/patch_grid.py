"""The patch-grid media rules (the Qwen-VL families' processors): an image keeps its aspect ratio,
resized to whole ``patch x merge`` blocks within pixel bounds, and becomes ``h x w`` patches and
``h * w / merge**2`` LLM tokens (:class:`SmartResize`); a video is sampled at a frame rate and
grouped into temporal patches of frames, each group resized as an image (:class:`VideoFrames`).
The sizes are what the image processor computes, so the shape policy counts as the processor does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dflop_ds.data.video import VIDEO_MIN_FRAMES, sampled_frame_count


def no_grid() -> torch.Tensor:
    """``[0, 3]``: the ``(t, h, w)`` grids of no images or videos."""
    return torch.zeros(0, 3, dtype=torch.long)


@dataclass(frozen=True)
class SmartResize:
    """The patch-grid image size rule (``smart_resize`` of the Qwen-VL image processors): an image
    is resized to multiples of ``patch_size * merge_size`` keeping its aspect ratio, its area within
    ``min_pixels``..``max_pixels``; ``(width, height) -> (patches, LLM tokens)`` (a
    :data:`~dflop_ds.shapes.ImageRule`)."""

    patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int

    def __post_init__(self) -> None:
        if self.patch_size < 1 or self.merge_size < 1:
            raise ValueError(f"patch_size {self.patch_size} and merge_size {self.merge_size} must be at least 1")
        factor = self.patch_size * self.merge_size
        if not factor**2 <= self.min_pixels <= self.max_pixels:
            raise ValueError(
                f"size {{'shortest_edge': {self.min_pixels}, 'longest_edge': {self.max_pixels}}} (min_pixels,"
                f" max_pixels): need {factor**2} (one merged patch, (patch_size x merge_size)^2) <= shortest_edge"
                " <= longest_edge"
            )

    @classmethod
    def from_image_processor(cls, image_processor: Any) -> SmartResize:
        """The rule of a patch-grid image processor (its ``size`` edges are the pixel bounds)."""
        size = image_processor.size
        return cls(
            int(image_processor.patch_size),
            int(image_processor.merge_size),
            int(size["shortest_edge"]),
            int(size["longest_edge"]),
        )

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """``(grid_h, grid_w)`` patches of an image of ``width x height`` pixels after resizing."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        new_h, new_w = smart_resize(
            height, width, self.patch_size * self.merge_size, min_pixels=self.min_pixels, max_pixels=self.max_pixels
        )
        return new_h // self.patch_size, new_w // self.patch_size

    def __call__(self, width: int, height: int) -> tuple[int, int]:
        grid_h, grid_w = self.grid(width, height)
        return grid_h * grid_w, grid_h * grid_w // self.merge_size**2


@dataclass(frozen=True)
class VideoFrames:
    """The patch-grid video rule: ``fps`` sampled frames per second of video (at least
    :data:`VIDEO_MIN_FRAMES`, at most ``max_frames``, rounded down to ``temporal_patch_size``), each
    resized by ``resize``; ``(frames, width, height, source fps) -> (patches, LLM tokens, patches per
    frame group)`` (a :data:`~dflop_ds.shapes.VideoRule`: the tower attends within each frame group)."""

    resize: SmartResize
    fps: float
    max_frames: int
    temporal_patch_size: int

    def sampled(self, frames: int, source_fps: float) -> int:
        """Frames sampled from a video of ``frames`` frames at ``source_fps``.

        Raises:
            ValueError: the video has fewer frames than one temporal patch.
        """
        count = sampled_frame_count(
            frames,
            source_fps,
            target_fps=self.fps,
            max_frames=self.max_frames,
            min_frames=VIDEO_MIN_FRAMES,
            multiple=self.temporal_patch_size,
        )
        if count < self.temporal_patch_size:
            raise ValueError(
                f"a video of {frames} frame(s) is shorter than one temporal patch ({self.temporal_patch_size} frames)"
            )
        return count

    def grid(self, frames: int, width: int, height: int, source_fps: float) -> tuple[int, int, int]:
        """``(t, h, w)``: the video's patch grid (``t`` frame pairs of ``h x w`` patches)."""
        grid_h, grid_w = self.resize.grid(width, height)
        return self.sampled(frames, source_fps) // self.temporal_patch_size, grid_h, grid_w

    def __call__(self, frames: int, width: int, height: int, source_fps: float) -> tuple[int, int, int]:
        t, h, w = self.grid(frames, width, height, source_fps)
        return t * h * w, t * h * w // self.resize.merge_size**2, h * w


__all__ = ["SmartResize", "VideoFrames", "no_grid"]
