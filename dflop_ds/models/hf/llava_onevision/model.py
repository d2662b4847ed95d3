"""``LlavaOnevisionForConditionalGeneration`` as pipeline layer lists.

The microbatch contract is LLaVA's with one more integer tensor:
``inputs = (pixel_values [T, C, H, W], input_ids [B, S], seq_lens [B], media [M, 5])``. ``pixel_values``
holds every tile of the microbatch, media after media (an AnyRes image's base tile then its grid
tiles; a lone tile for an image of a multi-image sample; a video's frames); ``media`` has one row
per image or video, in that order: ``(sample, is_video, height, width, tiles)`` (the original
height and width of an image; 0 for a video). The encoder is LLaVA's (the tower over all tiles,
``media`` carried along); the projector projects the tiles' features, packs each image as HF does
(un-padding, newline tokens, pooling of large grids; HF's own ``pack_image_features``), pools each
video's frames (HF's ``apply_pooling``) and closes it with a newline, then writes images at the
``<image>`` tokens and videos at the ``<video>`` tokens; the decoder is LLaVA's.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from dflop_ds.models.hf.base.layers import LMHead, decoder_layers, load_checked, tied_embedding_key
from dflop_ds.models.hf.base.vision import TileEncoderInputs, VisionEmbeddings, VisionLayer, feature_depth
from dflop_ds.shapes import split_evenly

MODEL_TYPE = "llava_onevision"
VISION_TYPES = ("siglip_vision_model", "clip_vision_model")
TEXT_TYPES = ("qwen2", "llama", "mistral")
#: columns of the ``media`` tensor
SAMPLE, IS_VIDEO, HEIGHT, WIDTH, TILES = range(5)

OnevisionTuple = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def check_onevision_config(config: Any, where: str = "model") -> None:
    """Refuse a config this adapter cannot run, naming ``where`` and what is supported."""
    kind = getattr(config, "model_type", None)
    if kind != MODEL_TYPE:
        raise ValueError(f"{where}: model type {kind!r} is not supported by the LLaVA-OneVision adapter")
    if config.vision_config.model_type not in VISION_TYPES:
        raise ValueError(f"{where}: vision tower {config.vision_config.model_type!r} is not supported {VISION_TYPES}")
    if config.text_config.model_type not in TEXT_TYPES:
        raise ValueError(f"{where}: text model {config.text_config.model_type!r} is not supported {TEXT_TYPES}")
    if not isinstance(config.vision_feature_layer, int):
        raise ValueError(f"{where}: a list vision_feature_layer is not supported (got {config.vision_feature_layer})")
    if not str(config.vision_aspect_ratio).startswith("anyres_max_"):
        raise ValueError(f"{where}: vision_aspect_ratio {config.vision_aspect_ratio!r} is not anyres_max_N")


def load_llava_onevision(model_dir: str | Path, *, dtype: torch.dtype | None = None) -> Any:
    """Load a ``save_pretrained`` LLaVA-OneVision directory (offline)."""
    import transformers

    return load_checked(
        model_dir, check_onevision_config, lambda config: transformers.LlavaOnevisionForConditionalGeneration, dtype
    )


class CarryMedia(nn.Module):
    """A LLaVA encoder layer over ``(vis, input_ids, seq_lens)`` that carries ``media`` along."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, inputs: OnevisionTuple) -> OnevisionTuple:
        """Run the wrapped layer on the first three entries; ``media`` passes through."""
        *head, media = inputs
        return (*self.layer(tuple(head)), media)


class OnevisionProjector(nn.Module):
    """Feature selection, projection, HF's packing of images and pooling of videos, and the merge:
    ``(vis, input_ids, seq_lens, media) -> (hidden [B, S, D], seq_lens)``.

    A microbatch without media brings the tower's one placeholder tile; its features (and the
    newline) are sliced to nothing, so the graph, and every rank's gradient order, stays the same.
    """

    def __init__(self, body: Any, config: Any, tied_key: str | None = None) -> None:
        super().__init__()
        self.projector = body.multi_modal_projector
        self.embed_tokens = body.language_model.embed_tokens
        self.image_newline = body.image_newline
        self.hf_config = config
        self.pack_images = type(body).pack_image_features
        self.pool_frames = type(body).apply_pooling
        self.tied_weights = {} if tied_key is None else {tied_key: "embed_tokens.weight"}

    def _media_features(self, features: torch.Tensor, media: torch.Tensor) -> tuple[list, list]:
        """Each image's and each video's packed features, in order."""
        owner = SimpleNamespace(config=self.hf_config)  # what HF's packing and pooling read
        images: list[torch.Tensor] = []
        videos: list[torch.Tensor] = []
        start = 0
        for row in media.tolist():
            tiles = features[start : start + row[TILES]]
            start += row[TILES]
            if row[IS_VIDEO]:
                pooled = self.pool_frames(owner, tiles).flatten(0, 1)
                videos.append(torch.cat([pooled, self.image_newline[None].to(pooled)]))
            else:
                size = torch.tensor([[row[HEIGHT], row[WIDTH]]])
                packed, _ = self.pack_images(
                    owner,
                    [tiles],
                    size,
                    image_newline=self.image_newline,
                    vision_aspect_ratio=self.hf_config.vision_aspect_ratio,
                )
                images.append(packed[0])
        if start != features.shape[0]:
            raise ValueError(f"OnevisionProjector: media rows name {start} tiles, the encoder gave {features.shape[0]}")
        return images, videos

    def forward(self, inputs: OnevisionTuple) -> tuple[torch.Tensor, torch.Tensor]:
        """Merge image and video features into the token embeddings at their tokens."""
        vis, input_ids, seq_lens, media = inputs
        if self.hf_config.vision_feature_select_strategy == "default":
            vis = vis[:, 1:]
        features = self.projector(vis)
        embeds = self.embed_tokens(input_ids)
        empty = features.flatten(0, 1)[:0]
        videos: list[torch.Tensor] = []
        if media.shape[0] == 0:  # the placeholder tile of a microbatch without media
            images = [empty, self.image_newline[None][:0].to(empty)]
        else:
            images, videos = self._media_features(features, media)
        for token_id, parts, what in (
            (self.hf_config.image_token_id, images, "image"),
            (self.hf_config.video_token_id, videos, "video"),
        ):
            merged = torch.cat(parts) if parts else empty
            positions = input_ids == token_id
            if int(positions.sum()) != merged.shape[0]:
                raise ValueError(
                    f"OnevisionProjector: the microbatch has {int(positions.sum())} {what} tokens but its "
                    f"{what}s give {merged.shape[0]} features"
                )
            embeds = embeds.masked_scatter(positions.unsqueeze(-1).expand_as(embeds), merged.to(embeds.dtype))
        return embeds, seq_lens


class OnevisionEncoderInputs(TileEncoderInputs):
    """Profiler input factory of the first encoder layer: ``(tiles, batch) -> (pixel_values,
    input_ids, seq_lens, media)``: ``tiles`` one-tile images (a base tile and its newline each)
    spread evenly over ``batch`` rows, each row holding its images' tokens then the text tokens."""

    def __init__(self, config: Any, text_tokens: int = 8, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(config, text_tokens, dtype)
        side = int(config.vision_config.image_size) // int(config.vision_config.patch_size)
        self.tokens_per_image = side * side + 1 - (1 if config.vision_feature_select_strategy == "default" else 0)
        self.video_token_id = int(config.video_token_id)

    def __call__(self, tiles: int, batch: int = 1) -> OnevisionTuple:  # type: ignore[override]
        pixel_values, input_ids, seq_lens = super().__call__(tiles, batch)
        text_id = next(i for i in range(3) if i not in (self.image_token_id, self.video_token_id))
        input_ids[input_ids == self.video_token_id] = text_id  # no video in a profiling row
        per_row = split_evenly(tiles, batch)
        rows = [[row, 0, self.image_size, self.image_size, 1] for row, n in enumerate(per_row) for _ in range(n)]
        return pixel_values, input_ids, seq_lens, torch.tensor(rows, dtype=torch.long).reshape(-1, 5)


def llava_onevision_layers(model: Any) -> tuple[list[nn.Module], nn.Module, list[nn.Module]]:
    """``(encoder_layers, projector, llm_layers)`` of a ``LlavaOnevisionForConditionalGeneration``,
    sharing its weights (tied embeddings declare :data:`~dflop_ds.models.hf.llava.model.TIED_EMBEDDING_KEY`)."""
    config = model.config
    check_onevision_config(config, type(model).__name__)
    body = model.model
    tower, language_model = body.vision_tower, body.language_model
    vision = getattr(tower, "vision_model", tower)
    encoder: list[nn.Module] = [CarryMedia(VisionEmbeddings(vision.embeddings, getattr(vision, "pre_layrnorm", None)))]
    encoder += [CarryMedia(VisionLayer(layer)) for layer in list(vision.encoder.layers)[: feature_depth(config)]]
    key = tied_embedding_key(model.lm_head, language_model)
    projector = OnevisionProjector(body, config, tied_key=key)
    llm: list[nn.Module] = [*decoder_layers(language_model), LMHead(language_model.norm, model.lm_head, tied_key=key)]
    return encoder, projector, llm


__all__ = [
    "MODEL_TYPE",
    "CarryMedia",
    "OnevisionEncoderInputs",
    "OnevisionProjector",
    "check_onevision_config",
    "llava_onevision_layers",
    "load_llava_onevision",
]
