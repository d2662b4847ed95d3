"""Where a patch-grid projector (Qwen2-VL's, Qwen3-VL's) writes the merger's features: each image's
at its image tokens, then each video's (or frame group's) at its video tokens, in microbatch order,
and the M-RoPE positions of the result (:func:`~dflop_ds.models.hf.base.mrope.mrope_position_ids`)."""

from __future__ import annotations

from typing import Any

import torch

from dflop_ds.models.hf.base import mrope


class VisualMerge:
    """The token ids and merge size of a patch-grid model's ``config``; ``owner`` names the projector
    in messages."""

    def __init__(self, config: Any, owner: str) -> None:
        self.image_token_id = int(config.image_token_id)
        self.video_token_id = int(config.video_token_id)
        self.merge_size = int(config.vision_config.spatial_merge_size)
        self.owner = owner

    def split(
        self, input_ids: torch.Tensor, features: torch.Tensor, grid: torch.Tensor, video_grid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(features, grid, image_positions, video_positions)``: the placeholder image of a microbatch
        without images and videos dropped (from ``features`` and ``grid``), the masks of the image and
        video tokens; ``ValueError`` naming the owner when the tokens and the grids' features differ."""
        image_positions, video_positions = input_ids == self.image_token_id, input_ids == self.video_token_id
        n_image, n_video = int(image_positions.sum()), int(video_positions.sum())
        if n_image == n_video == 0 and not video_grid.shape[0] and mrope.is_placeholder(grid, self.merge_size):
            features, grid = features[:0], grid[:0]
        unit = self.merge_size**2
        image_features, video_features = int(grid.prod(-1).sum()) // unit, int(video_grid.prod(-1).sum()) // unit
        if not (n_image == image_features and n_video == video_features == features.shape[0] - image_features):
            raise ValueError(
                f"{self.owner}: the microbatch has {n_image} image and {n_video} video tokens but its "
                f"{grid.shape[0]} image(s) of grids {grid.tolist()} and {video_grid.shape[0]} video grid(s) "
                f"{video_grid.tolist()} give {features.shape[0]} features"
            )
        return features, grid, image_positions, video_positions

    def scatter(
        self, embeds: torch.Tensor, features: torch.Tensor, image_positions: torch.Tensor, video_positions: torch.Tensor
    ) -> torch.Tensor:
        """``embeds`` with the image features (the first ones) at the image tokens and the rest at the
        video tokens."""
        features = features.to(embeds.dtype)
        n_image = int(image_positions.sum())
        hidden = embeds.masked_scatter(image_positions.unsqueeze(-1).expand_as(embeds), features[:n_image])
        if int(video_positions.sum()):
            hidden = hidden.masked_scatter(video_positions.unsqueeze(-1).expand_as(hidden), features[n_image:])
        return hidden

    def positions(
        self, input_ids: torch.Tensor, seq_lens: torch.Tensor, grid: torch.Tensor, video_grid: torch.Tensor
    ) -> torch.Tensor:
        """The M-RoPE position ids ``[3, B, S]`` of the microbatch (its image and video grids)."""
        return mrope.mrope_position_ids(
            input_ids,
            seq_lens,
            grid,
            image_token_id=self.image_token_id,
            merge_size=self.merge_size,
            video_grid_thw=video_grid,
            video_token_id=self.video_token_id,
        )


__all__ = ["VisualMerge"]
