"""Qwen3-VL's video rule: its processor writes each temporal patch of a video (a group of
``temporal_patch_size`` sampled frames) as the group's time in text, ``<{t:.1f} seconds>`` (the mean
of its first and last frame's times), then ``<|vision_start|>``, the group's ``h * w / merge**2``
video tokens and ``<|vision_end|>`` (``Qwen3VLProcessor.replace_video_token``); the model's M-RoPE
then takes each group as an image of one frame. :class:`TimestampedFrames` samples and grids a video
as :class:`~dflop_ds.models.hf.base.patch_grid.VideoFrames` does and counts all of that block."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from dflop_ds.data.video import sample_frame_indices
from dflop_ds.models.hf.base.patch_grid import VideoFrames


def group_seconds(indices: list[int], group: int, fps: float) -> list[float]:
    """Seconds of each group of ``group`` consecutive sampled frames (``indices`` at ``fps``): the
    mean of its first and last frame's times, as the processor computes them."""
    return [(indices[i] + indices[i + group - 1]) / 2 / fps for i in range(0, len(indices), group)]


def timestamped_block(
    seconds: list[float], tokens: list[int], text_ids: Callable[[str], list[int]], marks: tuple[int, int]
) -> list[int]:
    """Per frame group, ``<{seconds:.1f} seconds>`` (``text_ids`` of it), the opening mark, the group's
    ``tokens`` and the closing mark (``marks``: ``<|vision_start|>``, ``<|vision_end|>``)."""
    ids: list[int] = []
    for time in seconds:
        ids += text_ids(f"<{time:.1f} seconds>") + [marks[0], *tokens, marks[1]]
    return ids


@dataclass(frozen=True)
class TimestampedFrames(VideoFrames):
    """:class:`~dflop_ds.models.hf.base.patch_grid.VideoFrames` whose LLM tokens are the whole
    timestamped block of :meth:`block` (``text_ids``: the tokenizer's ids of a piece of text)."""

    text_ids: Callable[[str], list[int]] = field(compare=False, repr=False)
    video_token_id: int
    vision_start_id: int
    vision_end_id: int

    def timestamps(self, frames: int, source_fps: float) -> list[float]:
        """Seconds of each temporal patch of a video of ``frames`` frames at ``source_fps``: the mean
        of its first and last sampled frame's times (the sampled frames of :meth:`sampled`)."""
        indices = sample_frame_indices(frames, self.sampled(frames, source_fps))
        return group_seconds(indices, self.temporal_patch_size, source_fps)

    def block(self, frames: int, width: int, height: int, source_fps: float) -> list[int]:
        """The ids the processor writes for the video: per temporal patch ``<t seconds>``,
        ``<|vision_start|>``, its video tokens and ``<|vision_end|>``."""
        _, grid_h, grid_w = self.grid(frames, width, height, source_fps)
        tokens = [self.video_token_id] * (grid_h * grid_w // self.resize.merge_size**2)
        marks = (self.vision_start_id, self.vision_end_id)
        return timestamped_block(self.timestamps(frames, source_fps), tokens, self.text_ids, marks)

    def __call__(self, frames: int, width: int, height: int, source_fps: float) -> tuple[int, int, int]:
        units, _, window = super().__call__(frames, width, height, source_fps)
        return units, len(self.block(frames, width, height, source_fps)), window


__all__ = ["TimestampedFrames", "group_seconds", "timestamped_block"]
