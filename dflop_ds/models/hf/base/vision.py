"""Vision and projector layers the HF families with a ViT tower share, each wrapping the HF
submodule itself and mapping ``(vis or pixel_values, input_ids, seq_lens)`` tuples (the pipeline
contract, ``docs/architecture.md``): the tower's embeddings and layers, the projector that merges
image features into the token embeddings, and the profiler's input factory for the first layer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dflop_ds.shapes import split_evenly

VisTuple = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def feature_depth(config: Any) -> int:
    """Tower layers that feed ``hidden_states[vision_feature_layer]`` (``hidden_states[0]`` is the embedding)."""
    n = int(config.vision_config.num_hidden_layers)
    return int(config.vision_feature_layer) % (n + 1)


class VisionEmbeddings(nn.Module):
    """First encoder layer: ``pixel_values [N, C, H, W] -> vis [N, P, Dv]`` (patches, positions,
    CLIP's ``pre_layrnorm``), as ``hidden_states[0]`` of the HF tower."""

    def __init__(self, embeddings: nn.Module, pre_layernorm: nn.Module | None) -> None:
        super().__init__()
        self.embeddings = embeddings
        self.pre_layernorm = pre_layernorm

    def forward(self, inputs: VisTuple) -> VisTuple:
        """Embed every image. A microbatch without images embeds one blank placeholder image
        instead, which the projector drops (see :class:`FeatureProjector`): the tower then runs
        the same operations with or without images, so every rank's backward produces the same
        gradients in the same order (ZeRO reduces them in buckets filled in that order, and an
        unused layer on one rank only mismatches the ranks' collectives)."""
        pixel_values, input_ids, seq_lens = inputs
        weight = next(self.embeddings.parameters())
        if pixel_values.shape[0] == 0:
            pixel_values = pixel_values.new_zeros((1, *pixel_values.shape[1:]))
        vis = self.embeddings(pixel_values.to(weight.dtype))
        if self.pre_layernorm is not None:
            vis = self.pre_layernorm(vis)
        return vis, input_ids, seq_lens


class VisionLayer(nn.Module):
    """One vision-tower layer over every image's patches (no mask: all patches are real).
    ``takes_mask``: whether the HF layer's second argument is an attention mask (CLIP, SigLIP; an
    InternViT layer takes the hidden states alone)."""

    def __init__(self, layer: nn.Module, takes_mask: bool = True) -> None:
        super().__init__()
        self.layer = layer
        self.takes_mask = takes_mask

    def forward(self, inputs: VisTuple) -> VisTuple:
        """Refine ``vis``; an empty ``vis`` (no image) passes through (HF layers cannot reshape it)."""
        vis, input_ids, seq_lens = inputs
        if vis.shape[0] == 0:
            return vis.clone(), input_ids, seq_lens
        out = self.layer(vis, None) if self.takes_mask else self.layer(vis)
        return (out[0] if isinstance(out, tuple) else out), input_ids, seq_lens


class FeatureProjector(nn.Module):
    """Feature selection, ``multi_modal_projector``, token embedding and the merge:
    ``(vis, input_ids, seq_lens) -> (hidden [B, S, D], seq_lens)``.

    The projected features of the microbatch's images, in order, replace the embeddings of the
    ``image_token_id`` positions in row-major order (what ``LlavaModel`` does). Their counts must
    agree. A microbatch without image tokens brings the tower's one placeholder image, whose
    features are dropped here (sliced to nothing, so the graph, and every rank's gradient
    order, stays the same; the placeholder's gradient is zero).
    """

    def __init__(
        self,
        projector: nn.Module,
        embed_tokens: nn.Module,
        image_token_id: int,
        strategy: str,
        tied_key: str | None = None,
    ) -> None:
        super().__init__()
        self.projector = projector
        self.embed_tokens = embed_tokens
        self.image_token_id = int(image_token_id)
        self.strategy = strategy
        self.tied_weights = {} if tied_key is None else {tied_key: "embed_tokens.weight"}

    def forward(self, inputs: VisTuple) -> tuple[torch.Tensor, torch.Tensor]:
        """Merge image features into the token embeddings where the prompt put the image tokens."""
        vis, input_ids, seq_lens = inputs
        if self.strategy == "default":
            vis = vis[:, 1:]
        features = self.projector(vis)
        embeds = self.embed_tokens(input_ids)
        image_positions = input_ids == self.image_token_id
        n_tokens = int(image_positions.sum())
        if n_tokens == 0 and features.shape[0] == 1:  # the placeholder of a microbatch without images
            features = features[:0]
        n_features = features.shape[0] * features.shape[1]
        if n_tokens != n_features:
            raise ValueError(
                f"FeatureProjector: the microbatch has {n_tokens} image tokens but its {features.shape[0]} "
                f"image(s) give {n_features} features ({features.shape[1]} per image)"
            )
        mask = image_positions.unsqueeze(-1).expand_as(embeds)
        hidden = embeds.masked_scatter(mask, features.to(embeds.dtype))
        return hidden, seq_lens


class TileEncoderInputs:
    """Profiler input factory of the first encoder layer: ``(tiles, batch) -> (pixel_values,
    input_ids, seq_lens)`` with ``tiles`` random images spread evenly over ``batch`` rows, each
    row holding its images' tokens then ``text_tokens`` text tokens (see ``dflop_ds.profile``)."""

    def __init__(self, config: Any, text_tokens: int = 8, dtype: torch.dtype = torch.float32) -> None:
        vision = config.vision_config
        self.image_size, self.channels = int(vision.image_size), int(getattr(vision, "num_channels", 3))
        self.image_token_id, self.vocab_size = int(config.image_token_id), int(config.text_config.vocab_size)
        self.tokens_per_image = int(getattr(config, "image_seq_length", 0)) or self._features(config)
        self.text_tokens, self.dtype = int(text_tokens), dtype

    @staticmethod
    def _features(config: Any) -> int:
        vision = config.vision_config
        patches = (int(vision.image_size) // int(vision.patch_size)) ** 2
        cls_token = 1 if vision.model_type == "clip_vision_model" else 0
        return patches + cls_token - (1 if config.vision_feature_select_strategy == "default" else 0)

    def __call__(self, tiles: int, batch: int = 1) -> VisTuple:
        per_row = split_evenly(tiles, batch)
        lengths = [n * self.tokens_per_image + self.text_tokens for n in per_row]
        input_ids = torch.randint(0, self.vocab_size, (batch, max(lengths)))
        input_ids[input_ids == self.image_token_id] = (self.image_token_id + 1) % self.vocab_size
        for row, n in enumerate(per_row):
            input_ids[row, : n * self.tokens_per_image] = self.image_token_id
        pixel_values = torch.randn(tiles, self.channels, self.image_size, self.image_size, dtype=self.dtype)
        return pixel_values, input_ids, torch.tensor(lengths, dtype=torch.long)


class GridEncoderInputs:
    """Profiler input factory of a patch-grid family's first encoder layer: ``(patches, batch) ->
    (pixel_values, input_ids, seq_lens, image_grid_thw, video_grid_thw)`` (no videos): one random
    image per row, ``patches`` (the shape policy's encoder units) spread over the ``batch`` rows
    (each image rounded up to whole ``merge x merge`` blocks, as a ``m x k`` strip), each row
    holding its image's tokens then ``text_tokens`` text tokens."""

    def __init__(self, config: Any, text_tokens: int = 8, dtype: torch.dtype = torch.float32) -> None:
        vision = config.vision_config
        self.merge = int(vision.spatial_merge_size)
        self.patch_dim = int(vision.in_channels) * int(vision.temporal_patch_size) * int(vision.patch_size) ** 2
        self.image_token_id, self.vocab_size = int(config.image_token_id), int(config.text_config.vocab_size)
        self.special = {self.image_token_id, int(config.video_token_id)}
        self.text_tokens, self.dtype = int(text_tokens), dtype

    def grids(self, patches: int, batch: int = 1) -> list[list[int]]:
        """The ``(t, h, w)`` grid of each row's image (rows without patches have none)."""
        block = self.merge**2
        return [[1, self.merge, self.merge * -(-n // block)] for n in split_evenly(patches, batch) if n > 0]

    def attention_units(self, patches: int, batch: int = 1) -> int:
        """The inputs' encoder attention units: each image attends within itself (its patches squared)."""
        return sum((t * h * w) ** 2 for t, h, w in self.grids(patches, batch))

    def __call__(self, patches: int, batch: int = 1) -> tuple[torch.Tensor, ...]:
        grids = self.grids(patches, batch)
        tokens = [t * h * w // self.merge**2 for t, h, w in grids] + [0] * (batch - len(grids))
        lengths = [n + self.text_tokens for n in tokens]
        input_ids = torch.randint(0, self.vocab_size, (batch, max(lengths)))
        for token in self.special:
            input_ids[input_ids == token] = min(set(range(self.vocab_size)) - self.special)
        for row, n in enumerate(tokens):
            input_ids[row, :n] = self.image_token_id
        grid = torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
        pixel_values = torch.randn(int(grid.prod(-1).sum()), self.patch_dim, dtype=self.dtype)
        return pixel_values, input_ids, torch.tensor(lengths, dtype=torch.long), grid, grid[:0]


__all__ = [
    "FeatureProjector",
    "GridEncoderInputs",
    "TileEncoderInputs",
    "VisTuple",
    "VisionEmbeddings",
    "VisionLayer",
    "feature_depth",
]
