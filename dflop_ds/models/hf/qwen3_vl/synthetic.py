"""Qwen3-VL contract microbatches built straight from (prompt, answer, images[, video frames]), for
checks and tests (:class:`~dflop_ds.models.hf.base.patch_inputs.PatchGridInputs`): every
``<|image_pad|>`` of the prompt is repeated as many times as the image gives LLM tokens, and the one
``<|video_pad|>`` of a sample with video frames becomes the video's timestamped frame groups
(:mod:`~dflop_ds.models.hf.qwen3_vl.shapes`). The result follows the Qwen3-VL microbatch contract
(``((pixel_values, input_ids, seq_lens, image_grid_thw, video_grid_thw), (targets, loss_denominator))``,
:mod:`dflop_ds.models.hf.qwen3_vl.model`).
"""

from __future__ import annotations

import torch

from dflop_ds.models.hf.base.patch_inputs import PatchGridInputs, patch_grid_hf_kwargs
from dflop_ds.models.hf.base.template import text_ids
from dflop_ds.models.hf.qwen3_vl.shapes import group_seconds, timestamped_block

#: how a prompt marks an image (Qwen3-VL's chat template)
IMAGE_MARK = "<|vision_start|><|image_pad|><|vision_end|>"


#: how a prompt marks a video (Qwen3-VL's chat template)
VIDEO_MARK = "<|vision_start|><|video_pad|><|vision_end|>"
#: the frame rate synthetic video frames are taken at (their timestamps' text)
SYNTHETIC_FPS = 2.0


class Qwen3VLInputs(PatchGridInputs):
    """Tokenizer + image processor of a Qwen3-VL model directory, checked against the model config:
    microbatches with images and videos (:class:`~dflop_ds.models.hf.base.patch_inputs.PatchGridInputs`),
    a video's frames taken at :data:`SYNTHETIC_FPS` and written as its processor writes them."""

    def video_ids(self, grid: torch.Tensor) -> list[int]:
        """Per frame group of ``grid``'s ``(t, h, w)``: its timestamp, ``<|vision_start|>``, its tokens
        and ``<|vision_end|>`` (:func:`~dflop_ds.models.hf.qwen3_vl.shapes.timestamped_block`)."""
        groups, grid_h, grid_w = (int(n) for n in grid.tolist())
        frames = list(range(groups * self.temporal_patch_size))
        seconds = group_seconds(frames, self.temporal_patch_size, SYNTHETIC_FPS)
        marks = tuple(int(self.tokenizer.convert_tokens_to_ids(t)) for t in ("<|vision_start|>", "<|vision_end|>"))
        tokens = [self.video_token_id] * (grid_h * grid_w // self.merge_size**2)
        return timestamped_block(seconds, tokens, lambda text: text_ids(self.tokenizer, text), marks)  # type: ignore[arg-type]


#: The HF Qwen3-VL model's keyword arguments for a contract microbatch.
qwen3_vl_hf_kwargs = patch_grid_hf_kwargs

__all__ = ["IMAGE_MARK", "SYNTHETIC_FPS", "VIDEO_MARK", "Qwen3VLInputs", "qwen3_vl_hf_kwargs"]
