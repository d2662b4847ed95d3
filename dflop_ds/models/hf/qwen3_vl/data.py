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
* **Videos** are refused by name (Qwen3-VL's video processor, which writes the per-frame
  timestamps, needs torchvision, which does not load here).
* **Length**: as for every family (``max_length``, ``truncation``); a cut keeps every image block whole.
"""

from __future__ import annotations

from collections.abc import Sequence

from dflop_ds.models.hf.base.patch_grid import SmartResize
from dflop_ds.models.hf.base.patch_grid_data import (
    PatchGridDataset,
    PatchGridItem,
    PatchGridPreprocessor,
    collate_patch_grid,
)
from dflop_ds.models.hf.qwen3_vl.synthetic import Qwen3VLInputs

DEFAULT_SYSTEM = PatchGridPreprocessor.default_system

#: a Qwen3-VL sample (the patch-grid item; no video)
Qwen3VLItem = PatchGridItem


class Qwen3VLPreprocessor(PatchGridPreprocessor):
    """A Qwen3-VL directory's tokenizer and image processor plus its conversation template
    (arguments as :class:`~dflop_ds.models.hf.base.patch_grid_data.PatchGridPreprocessor`; the
    video settings are accepted for the family interface, videos are refused)."""

    family_name = "qwen3_vl"
    template_name = "qwen3-vl-chatml"
    inputs_class = Qwen3VLInputs

    def count(
        self, turns: Sequence[tuple[str, str]], image_tokens: Sequence[int], video_tokens: int | None = None
    ) -> tuple[int, int]:
        """``(text_tokens, label_tokens)`` exactly as :meth:`encode` produces them (image tokens excluded).

        Raises:
            ValueError: the record has a video (named: Qwen3-VL's videos are not supported yet).
        """
        if video_tokens is not None:
            raise ValueError(
                f"{self.name}: videos are not supported for Qwen3-VL yet (its video processor, which "
                "writes each frame's timestamp, needs torchvision)"
            )
        return super().count(turns, image_tokens)


class Qwen3VLDataset(PatchGridDataset):
    """The samples of ``shapes`` (made under ``preprocessor.policy()``) as Qwen3-VL contract tensors
    (arguments as :class:`~dflop_ds.models.hf.base.dataset.MediaDataset`; a sample with a video is
    refused by name)."""

    preprocessor: Qwen3VLPreprocessor
    supports_video = False


def collate_qwen3_vl(items: Sequence[PatchGridItem], packed: bool = False):
    """One microbatch ``((pixel_values, input_ids, seq_lens, image_grid_thw), (targets, loss_denominator))``
    (:func:`~dflop_ds.models.hf.base.patch_grid_data.collate_patch_grid` without videos)."""
    return collate_patch_grid(items, packed, videos=False)


def collate_packed_qwen3_vl(items: Sequence[PatchGridItem]):
    """:func:`collate_qwen3_vl` with ``packed=True`` (a picklable collate for DataLoader workers)."""
    return collate_patch_grid(items, packed=True, videos=False)


__all__ = [
    "DEFAULT_SYSTEM",
    "Qwen3VLDataset",
    "Qwen3VLItem",
    "Qwen3VLPreprocessor",
    "SmartResize",
    "collate_packed_qwen3_vl",
    "collate_qwen3_vl",
]
