"""LLaVA JSON records -> the Qwen2-VL microbatch contract (``dflop_ds.models.hf.qwen2_vl.model``).

:class:`Qwen2VLPreprocessor` is the patch-grid preprocessor
(:class:`~dflop_ds.models.hf.base.patch_grid_data.PatchGridPreprocessor`) of a Qwen2-VL directory's
tokenizer and ``Qwen2VLImageProcessor`` (no processor class needed: Qwen2-VL's wants torchvision
for videos):

* **Template**: the checkpoint's own ``chat_template`` when it ships one (its ``<|image_pad|>``
  and ``<|video_pad|>`` expanded to the media's tokens); otherwise ChatML
  (:mod:`~dflop_ds.models.hf.base.chatml`) with Qwen's default system message.
* **Images**: each ``<image>`` becomes ``<|vision_start|>`` + the image's ``<|image_pad|>`` tokens
  + ``<|vision_end|>``; an image gives as many tokens as its own size allows
  (:class:`~dflop_ds.models.hf.base.patch_grid.SmartResize`, the image processor's rule).
* **Videos** (LLaVA-Video records): sampled at ``video_fps`` frames per second, at least 4 and at
  most ``video_max_frames``, rounded down to the temporal patch size (2), as Qwen2-VL's recipes
  sample (:class:`~dflop_ds.models.hf.base.patch_grid.VideoFrames`), decoded with PyAV and grouped
  in pairs into ``pixel_values_videos`` patches; the video's placeholder becomes
  ``<|vision_start|>`` + its ``<|video_pad|>`` tokens + ``<|vision_end|>``. Qwen2.5-VL's videos
  (temporal positions scaled by seconds per frame group) are refused by name.
* **Length**: as for every family; a cut keeps every visual block whole.
"""

from __future__ import annotations

from collections.abc import Sequence

from dflop_ds.data.video import DEFAULT_VIDEO_FPS, DEFAULT_VIDEO_MAX_FRAMES
from dflop_ds.models.hf.base.patch_grid import SmartResize, VideoFrames
from dflop_ds.models.hf.base.patch_grid_data import (
    PatchGridDataset,
    PatchGridItem,
    PatchGridPreprocessor,
    collate_patch_grid,
)
from dflop_ds.models.hf.base.template import mark_video
from dflop_ds.models.hf.qwen2_vl.synthetic import Qwen2VLInputs

DEFAULT_SYSTEM = PatchGridPreprocessor.default_system

#: a Qwen2-VL sample (the patch-grid item)
Qwen2VLItem = PatchGridItem


class Qwen2VLPreprocessor(PatchGridPreprocessor):
    """A Qwen2-VL directory's tokenizer and image processor plus its conversation template
    (arguments as :class:`~dflop_ds.models.hf.base.patch_grid_data.PatchGridPreprocessor`)."""

    family_name = "qwen2_vl"
    template_name = "qwen2-vl-chatml"
    inputs_class = Qwen2VLInputs
    video_model_types = ("qwen2_vl",)


class Qwen2VLDataset(PatchGridDataset):
    """The samples of ``shapes`` (made under ``preprocessor.policy()``) as Qwen2-VL contract tensors
    (arguments as :class:`~dflop_ds.models.hf.base.dataset.MediaDataset`)."""

    preprocessor: Qwen2VLPreprocessor


def collate_qwen2_vl(items: Sequence[PatchGridItem], packed: bool = False):
    """One microbatch ``((pixel_values, input_ids, seq_lens, image_grid_thw, video_grid_thw), (targets,
    loss_denominator))`` (:func:`~dflop_ds.models.hf.base.patch_grid_data.collate_patch_grid`)."""
    return collate_patch_grid(items, packed)


def collate_packed_qwen2_vl(items: Sequence[PatchGridItem]):
    """:func:`collate_qwen2_vl` with ``packed=True`` (a picklable collate for DataLoader workers)."""
    return collate_patch_grid(items, packed=True)


__all__ = [
    "DEFAULT_SYSTEM",
    "DEFAULT_VIDEO_FPS",
    "DEFAULT_VIDEO_MAX_FRAMES",
    "Qwen2VLDataset",
    "Qwen2VLItem",
    "Qwen2VLPreprocessor",
    "SmartResize",
    "VideoFrames",
    "collate_packed_qwen2_vl",
    "collate_qwen2_vl",
    "mark_video",
]
