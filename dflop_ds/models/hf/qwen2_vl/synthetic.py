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

from dflop_ds.models.hf.base.patch_inputs import PatchGridInputs, VideoSample, patch_grid_hf_kwargs
from dflop_ds.models.hf.base.synthetic import hf_labels

#: how a prompt marks an image (Qwen2-VL's chat template)
IMAGE_MARK = "<|vision_start|><|image_pad|><|vision_end|>"
#: how a prompt marks a video (Qwen2-VL's chat template)
VIDEO_MARK = "<|vision_start|><|video_pad|><|vision_end|>"


class Qwen2VLInputs(PatchGridInputs):
    """Tokenizer + image processor of a Qwen2-VL model directory, checked against the model config:
    microbatches with images and videos (:class:`~dflop_ds.models.hf.base.patch_inputs.PatchGridInputs`)."""


#: The HF Qwen2-VL model's keyword arguments for a contract microbatch.
qwen2_vl_hf_kwargs = patch_grid_hf_kwargs


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
