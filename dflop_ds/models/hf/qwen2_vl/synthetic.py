"""Qwen2-VL contract microbatches built straight from (prompt, answer, images[, video frames]), for checks and tests.

The directory's tokenizer and image processor do the work of the Qwen2-VL processor class
(which needs torchvision): every ``<|image_pad|>`` of the prompt (one per image, as Qwen2-VL's
chat template writes it between ``<|vision_start|>`` and ``<|vision_end|>``) is repeated as many
times as the image gives LLM tokens (its patch grid ``t*h*w / merge**2``), and the one
``<|video_pad|>`` of a sample with video frames as many times as the video gives; the answer and
eos are appended and supervised. The result follows the Qwen2-VL microbatch contract
(``((pixel_values, input_ids, seq_lens, image_grid_thw, video_grid_thw), (targets,
loss_denominator))``, ``dflop_ds.models.hf.qwen2_vl.model``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dflop_ds.models.hf.base.layers import padding_mask
from dflop_ds.models.hf.base.patch_inputs import PatchGridInputs, VideoSample
from dflop_ds.models.hf.base.synthetic import hf_labels

#: how a prompt marks an image (Qwen2-VL's chat template)
IMAGE_MARK = "<|vision_start|><|image_pad|><|vision_end|>"
#: how a prompt marks a video (Qwen2-VL's chat template)
VIDEO_MARK = "<|vision_start|><|video_pad|><|vision_end|>"


class Qwen2VLInputs(PatchGridInputs):
    """Tokenizer + image processor of a Qwen2-VL model directory, checked against the model config:
    microbatches with images and videos (:class:`~dflop_ds.models.hf.base.patch_inputs.PatchGridInputs`)."""


def qwen2_vl_hf_kwargs(inputs: Sequence[torch.Tensor], config: Any) -> dict[str, Any]:
    """The HF Qwen2-VL model's keyword arguments for a contract microbatch: ``pixel_values`` and
    ``pixel_values_videos`` split at the images' patch count, ``mm_token_type_ids`` marking image
    tokens 1 and video tokens 2; no pixels nor grids of a kind the microbatch has none of."""
    pixel_values, input_ids, seq_lens, grid, video_grid = inputs
    kwargs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": padding_mask(seq_lens, input_ids.shape[1])}
    if grid.shape[0] or video_grid.shape[0]:
        kwargs["mm_token_type_ids"] = (input_ids == int(config.image_token_id)).int() + 2 * (
            input_ids == int(config.video_token_id)
        ).int()
    image_patches = int(grid.prod(-1).sum())
    if grid.shape[0]:
        kwargs.update(pixel_values=pixel_values[:image_patches], image_grid_thw=grid)
    if video_grid.shape[0]:
        kwargs.update(pixel_values_videos=pixel_values[image_patches:], video_grid_thw=video_grid)
    return kwargs


def qwen2_vl_hf_positions(model: Any, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """The M-RoPE position ids ``[3, B, S]`` HF's ``get_rope_index`` gives a contract microbatch
    (``0..S-1`` on every axis without images and videos, as HF's text-only forward counts)."""
    kwargs = qwen2_vl_hf_kwargs(inputs, model.config)
    input_ids = kwargs["input_ids"]
    if "mm_token_type_ids" not in kwargs:
        return torch.arange(input_ids.shape[1]).expand(3, *input_ids.shape)
    positions, _ = model.model.get_rope_index(
        input_ids,
        kwargs["mm_token_type_ids"],
        image_grid_thw=kwargs.get("image_grid_thw"),
        video_grid_thw=kwargs.get("video_grid_thw"),
        attention_mask=kwargs["attention_mask"],
    )
    return positions


def qwen2_vl_hf_forward(model: Any, inputs: Sequence[torch.Tensor], targets: torch.Tensor):
    """The HF model's own forward of a Qwen2-VL contract microbatch with labels (its loss: the token mean)."""
    return model(**qwen2_vl_hf_kwargs(inputs, model.config), labels=hf_labels(targets))


__all__ = [
    "IMAGE_MARK",
    "VIDEO_MARK",
    "Qwen2VLInputs",
    "VideoSample",
    "qwen2_vl_hf_forward",
    "qwen2_vl_hf_kwargs",
    "qwen2_vl_hf_positions",
]
