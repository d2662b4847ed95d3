"""What the registrations of the patch-grid families (Qwen2-VL, Qwen3-VL) share: the Trainer
path's placeholder image and padding-free parts, and the tower's hidden states for ``check-model``."""

from __future__ import annotations

from typing import Any

import torch

from dflop_ds.models.hf.trainer_parts import DEFAULT_MEDIA_KEYS, BlankImage, BlankVideo, TrainerParts, text_pad_token


def patch_grid_blank_image(config: Any) -> BlankImage:
    """The placeholder image ``[1, m, m]`` (one LLM token) as HF's model takes it: its flattened
    patches ``[m * m, C * T * p * p]`` and its ``image_grid_thw`` row; the same as a one-step
    video (the tower runs apart for images and videos)."""
    vision = config.vision_config
    merge = int(vision.spatial_merge_size)
    patch_dim = int(vision.in_channels) * int(vision.temporal_patch_size) * int(vision.patch_size) ** 2
    image_token_id, video_token_id = int(config.image_token_id), int(config.video_token_id)
    pad = text_pad_token(config, image_token_id, video_token_id)
    shape, grid = (merge**2, patch_dim), (1, merge, merge)
    video = BlankVideo(shape, video_token_id, 1, grid)
    return BlankImage(shape, image_token_id, 1, pad, grid, video=video)


def patch_grid_trainer() -> TrainerParts:
    """A patch-grid family on the Trainer path: its placeholder image; padding-free batches
    concatenate the samples' images, videos and grids, with M-RoPE positions from the model's
    ``get_rope_index``."""
    return TrainerParts(
        patch_grid_blank_image, media_keys=DEFAULT_MEDIA_KEYS, rope_index=lambda model: model.model.get_rope_index
    )


def patch_grid_vision_states(model: Any, pixel_values: torch.Tensor, grid: torch.Tensor) -> Any:
    """The HF tower's hidden states of the patches of ``grid`` (None without any)."""
    if not grid.shape[0]:
        return None
    return model.model.visual(pixel_values, grid_thw=grid, output_hidden_states=True).hidden_states


__all__ = ["patch_grid_blank_image", "patch_grid_trainer", "patch_grid_vision_states"]
