"""LLaVA JSON records -> the Qwen3-VL microbatch contract (:mod:`dflop_ds.models.hf.qwen3_vl.model`).

:class:`Qwen3VLPreprocessor` is the patch-grid preprocessor
(:class:`~dflop_ds.models.hf.base.patch_grid_data.PatchGridPreprocessor`) of a Qwen3-VL directory's
tokenizer and image processor (the one Qwen3-VL's processor class uses; the class itself is not
needed: its video processor wants torchvision):

* **Template**: the checkpoint's own ``chat_template`` when it ships one (its ``<|image_pad|>``
  expanded to the image's tokens); otherwise ChatML (:mod:`~dflop_ds.models.hf.base.chatml`).
* **Images** keep their own size within the image processor's pixel bounds, resized to multiples
  of ``patch * merge`` (32 px on the released checkpoints: patch 16, merge 2, temporal patch 2):
  :class:`~dflop_ds.models.hf.base.patch_grid.SmartResize` gives an image's patches (its
  ``encoder_tiles``) and LLM tokens (patches / merge**2, its ``visual_tokens``), exactly as the
  processor counts them.
* **Videos** (LLaVA-Video records) are sampled and gridded as Qwen2-VL's (``video_fps``,
  ``video_max_frames``, pairs of frames per temporal patch) and written as Qwen3-VL's processor
  writes them: per temporal patch its time ``<t seconds>``, ``<|vision_start|>``, its video tokens and
  ``<|vision_end|>`` (:mod:`~dflop_ds.models.hf.qwen3_vl.shapes`), all inside the placeholder's block;
  the shape counts the whole block as the video's LLM tokens.
* **Length**: as for every family (``max_length``, ``truncation``); a cut keeps every image block whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from dflop_ds.models.hf.base.patch_grid import SmartResize, VideoFrames
from dflop_ds.models.hf.base.patch_grid_data import (
    PatchGridDataset,
    PatchGridItem,
    PatchGridPreprocessor,
    collate_patch_grid,
)
from dflop_ds.models.hf.qwen3_vl.shapes import TimestampedFrames
from dflop_ds.models.hf.qwen3_vl.synthetic import Qwen3VLInputs
from dflop_ds.shapes import SampleShape

DEFAULT_SYSTEM = PatchGridPreprocessor.default_system

#: a Qwen3-VL sample (the patch-grid item)
Qwen3VLItem = PatchGridItem


class Qwen3VLPreprocessor(PatchGridPreprocessor):
    """A Qwen3-VL directory's tokenizer and image processor plus its conversation template
    (arguments as :class:`~dflop_ds.models.hf.base.patch_grid_data.PatchGridPreprocessor`); a video
    is written as its processor writes it (:class:`~dflop_ds.models.hf.qwen3_vl.shapes.TimestampedFrames`)."""

    family_name = "qwen3_vl"
    template_name = "qwen3-vl-chatml"
    inputs_class = Qwen3VLInputs

    def _video_rule(self, frames: VideoFrames) -> TimestampedFrames:
        """The timestamped rule over ``frames`` (``ValueError`` naming a vision token the tokenizer lacks)."""
        start, end = (self._token(token) for token in ("<|vision_start|>", "<|vision_end|>"))
        if start is None or end is None:
            raise ValueError(f"{self.name}: the tokenizer has no <|vision_start|>/<|vision_end|> to write videos with")
        return TimestampedFrames(
            frames.resize,
            frames.fps,
            frames.max_frames,
            frames.temporal_patch_size,
            text_ids=self._ids,
            video_token_id=int(self.video_token_id or 0),
            vision_start_id=start,
            vision_end_id=end,
        )

    def video_ids(self, shape: SampleShape, video_grid: torch.Tensor) -> list[int] | None:
        """The timestamped block of the video of ``shape`` (None: no video)."""
        if not video_grid.shape[0]:
            return None
        if shape.video_size is None or shape.video_fps is None:
            raise ValueError("its shape has no frame size or rate (read the data with a video_folder)")
        rule = cast(TimestampedFrames, self.video_rule)
        return rule.block(shape.video_frames, *shape.video_size, shape.video_fps)


class Qwen3VLDataset(PatchGridDataset):
    """The samples of ``shapes`` (made under ``preprocessor.policy()``) as Qwen3-VL contract tensors
    (arguments as :class:`~dflop_ds.models.hf.base.dataset.MediaDataset`)."""

    preprocessor: Qwen3VLPreprocessor


def collate_qwen3_vl(items: Sequence[PatchGridItem], packed: bool = False):
    """One microbatch ``((pixel_values, input_ids, seq_lens, image_grid_thw, video_grid_thw), (targets,
    loss_denominator))`` (:func:`~dflop_ds.models.hf.base.patch_grid_data.collate_patch_grid`)."""
    return collate_patch_grid(items, packed)


def collate_packed_qwen3_vl(items: Sequence[PatchGridItem]):
    """:func:`collate_qwen3_vl` with ``packed=True`` (a picklable collate for DataLoader workers)."""
    return collate_patch_grid(items, packed=True)


__all__ = [
    "DEFAULT_SYSTEM",
    "Qwen3VLDataset",
    "Qwen3VLItem",
    "Qwen3VLPreprocessor",
    "SmartResize",
    "collate_packed_qwen3_vl",
    "collate_qwen3_vl",
]
