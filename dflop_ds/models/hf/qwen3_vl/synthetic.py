"""Qwen3-VL contract microbatches built straight from (prompt, answer, images), for checks and tests.

The directory's tokenizer and image processor do the work of Qwen3-VL's processor class (whose
video processor needs torchvision): every ``<|image_pad|>`` of the prompt (one per image, as Qwen3-VL's
chat template writes it between ``<|vision_start|>`` and ``<|vision_end|>``) is repeated as many
times as the image gives LLM tokens (its patch grid ``t*h*w / merge**2``); the answer and eos are
appended and supervised. The result follows the Qwen3-VL microbatch contract
(``((pixel_values, input_ids, seq_lens, image_grid_thw), (targets, loss_denominator))``,
:mod:`dflop_ds.models.hf.qwen3_vl.model`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dflop_ds.models.hf.base.layers import padding_mask
from dflop_ds.models.hf.base.patch_inputs import PatchGridInputs

#: how a prompt marks an image (Qwen3-VL's chat template)
IMAGE_MARK = "<|vision_start|><|image_pad|><|vision_end|>"


class Qwen3VLInputs(PatchGridInputs):
    """Tokenizer + image processor of a Qwen3-VL model directory, checked against the model config:
    microbatches with images (:class:`~dflop_ds.models.hf.base.patch_inputs.PatchGridInputs`; videos
    are refused by name)."""

    takes_videos = False


def qwen3_vl_hf_kwargs(inputs: Sequence[torch.Tensor], config: Any) -> dict[str, Any]:
    """The HF Qwen3-VL model's keyword arguments for a contract microbatch: ``mm_token_type_ids``
    marking image tokens 1; no pixels nor grid without images."""
    pixel_values, input_ids, seq_lens, grid = inputs
    kwargs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": padding_mask(seq_lens, input_ids.shape[1])}
    if grid.shape[0]:
        kwargs.update(
            pixel_values=pixel_values,
            image_grid_thw=grid,
            mm_token_type_ids=(input_ids == int(config.image_token_id)).int(),
        )
    return kwargs


__all__ = ["IMAGE_MARK", "Qwen3VLInputs", "qwen3_vl_hf_kwargs"]
