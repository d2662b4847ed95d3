"""``InternVLForConditionalGeneration`` as pipeline layer lists, on LLaVA's microbatch contract
``(pixel_values [T, C, H, W], input_ids [B, S], seq_lens [B])``: ``pixel_values`` holds every tile
of the microbatch (an image's dynamic-tiling tiles then its thumbnail, or its one tile; a video's
frames, one tile each), and every tile gives ``image_seq_length`` ``<IMG_CONTEXT>`` tokens.

The encoder is the InternViT tower (patch and position embeddings with the CLS token, then its
layers up to ``vision_feature_layer``); the projector applies the tower's final norm when the last
layer is selected, drops the CLS feature (``"default"``), pixel-shuffles each tile's feature grid
(``downsample_ratio``, HF's own ``pixel_shuffle``) and runs ``multi_modal_projector`` before the
features replace the image-token embeddings; the decoder is LLaVA's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflop_ds.models.hf.base.layers import TEXT_TYPES, LMHead, decoder_layers, load_checked, tied_embedding_key
from dflop_ds.models.hf.base.vision import FeatureProjector, VisionEmbeddings, VisionLayer

MODEL_TYPE = "internvl"


def side(value: Any) -> int:
    """A square size given as an int or as ``[height, width]`` (InternViT's ``image_size``, ``patch_size``)."""
    return int(value[0] if isinstance(value, (list, tuple)) else value)


def check_internvl_config(config: Any, where: str = "model") -> None:
    """Refuse a config this adapter cannot run, naming ``where``."""
    kind = getattr(config, "model_type", None)
    if kind != MODEL_TYPE:
        raise ValueError(f"{where}: model type {kind!r} is not supported by the InternVL adapter")
    if config.text_config.model_type not in TEXT_TYPES:
        raise ValueError(f"{where}: text model {config.text_config.model_type!r} is not supported {TEXT_TYPES}")
    if not isinstance(config.vision_feature_layer, int):
        raise ValueError(f"{where}: a list vision_feature_layer is not supported (got {config.vision_feature_layer})")


def load_internvl(model_dir: str | Path, *, dtype: torch.dtype | None = None) -> Any:
    """Load a ``save_pretrained`` InternVL directory (offline)."""
    import transformers

    return load_checked(
        model_dir, check_internvl_config, lambda config: transformers.InternVLForConditionalGeneration, dtype
    )


class ShuffledProjector(nn.Module):
    """The final norm (for the last layer's features), CLS dropping, pixel shuffle and the
    ``multi_modal_projector`` of InternVL, in one module: ``vis [T, 1 + P, Dv] -> [T, P * r^2, D]``."""

    def __init__(self, body: Any, norm: nn.Module | None, config: Any) -> None:
        super().__init__()
        self.norm = norm
        self.projector = body.multi_modal_projector
        self.shuffle = type(body).pixel_shuffle
        self.owner = None  # pixel_shuffle reads nothing of its module
        self.ratio = float(config.downsample_ratio)
        self.drop_cls = config.vision_feature_select_strategy == "default"

    def forward(self, vis: torch.Tensor) -> torch.Tensor:
        """Project every tile's features."""
        if self.norm is not None:
            vis = self.norm(vis)
        if self.drop_cls:
            vis = vis[:, 1:]
        side = int(vis.shape[1] ** 0.5)
        grid = vis.reshape(vis.shape[0], side, side, -1)
        shuffled = self.shuffle(self.owner, grid, scale_factor=self.ratio)
        return self.projector(shuffled.reshape(vis.shape[0], -1, shuffled.shape[-1]))


def internvl_layers(model: Any) -> tuple[list[nn.Module], nn.Module, list[nn.Module]]:
    """``(encoder_layers, projector, llm_layers)`` of an ``InternVLForConditionalGeneration``, sharing its weights."""
    config = model.config
    check_internvl_config(config, type(model).__name__)
    body = model.model
    tower, language_model = body.vision_tower, body.language_model
    layers = list(tower.encoder.layer)
    depth = int(config.vision_feature_layer) % (len(layers) + 1)
    last = config.vision_feature_layer == -1  # HF takes the normed last_hidden_state then
    encoder: list[nn.Module] = [VisionEmbeddings(tower.embeddings, None)]
    encoder += [VisionLayer(layer, takes_mask=False) for layer in layers[: len(layers) if last else depth]]
    key = tied_embedding_key(model.lm_head, language_model)
    shuffled = ShuffledProjector(body, tower.layernorm if last else None, config)
    projector = FeatureProjector(shuffled, language_model.embed_tokens, config.image_token_id, "full", tied_key=key)
    llm: list[nn.Module] = [*decoder_layers(language_model), LMHead(language_model.norm, model.lm_head, tied_key=key)]
    return encoder, projector, llm


__all__ = [
    "MODEL_TYPE",
    "ShuffledProjector",
    "check_internvl_config",
    "side",
    "internvl_layers",
    "load_internvl",
]
