"""HF ``Qwen2VLForConditionalGeneration`` (and Qwen2.5-VL) as the pipeline's flat layer lists (docs/architecture.md).

Microbatch inputs: ``(pixel_values [P, C*T*p*p], input_ids [B, S], seq_lens [B], image_grid_thw [N, 3],
video_grid_thw [V, 3])``: every image's patches, flattened as ``Qwen2VLImageProcessor`` writes
them, images in microbatch order, then every video's patches (HF's ``pixel_values_videos``),
videos in microbatch order; the grids (long) are their ``(t, h, w)`` patch grids
(``P = sum(t*h*w)`` over both); every image's ``<|image_pad|>`` token and every video's
``<|video_pad|>`` token already repeated ``t*h*w / merge**2`` times. A microbatch without images
has ``N = 0``, one without videos ``V = 0``. The tower treats a video as ``t`` frame pairs, each
attending within itself, exactly as it treats images, so one pass embeds both.

:func:`qwen2_vl_layers` turns a loaded model into ``(encoder_layers, projector, llm_layers)``:

* encoder: :class:`PatchEmbedding` (a microbatch without images embeds one placeholder image),
  then one :class:`VisionBlock` per vision block. ``(vis [P, Dv], input_ids, seq_lens, image_grid,
  video_grid)``;
  every block attends within each image (``cu_seqlens`` from the grid) with the 2-D rotary
  table of its patches, both rebuilt from the integer grid in every block (they hold no
  weights, so only integers cross a stage boundary besides ``vis``).
* projector: :class:`Qwen2VLProjector`: the patch merger, token embedding, the features written
  at the ``<|image_pad|>`` and ``<|video_pad|>`` tokens, and the M-RoPE position ids
  (:func:`mrope_position_ids`):
  ``-> (hidden [B, S, D], position_ids [3, B, S], seq_lens)``.
* LLM: one :class:`MRopeDecoderLayer` per decoder layer, then the shared
  :class:`~dflop_ds.models.hf.base.layers.LMHead`.

Packed microbatches (:mod:`dflop_ds.models.packing`): ``input_ids [1, sum(seq_lens)]`` holds every
sample in one row; the projector gives each sample its own M-RoPE positions (restarting at 0) and
the decoder layers attend within each sample (:mod:`dflop_ds.models.hf.base.packed`).

Qwen2.5-VL (``model_type`` ``qwen2_5_vl``) differs in its tower only: patches are reordered
into attention windows after the embedding (:func:`window_index`), every block but the
``fullatt_block_indexes`` attends within windows, and the projector restores the order after
the merger. Its videos (temporal positions scaled by seconds per frame pair) are refused by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflop_ds.models.hf.base.layers import (
    TIED_EMBEDDING_KEY,
    DecoderLayer,
    LMHead,
    layer_mask_kinds,
    load_checked,
    tied_embedding_key,
)
from dflop_ds.models.hf.base.mrope import is_placeholder, mrope_position_ids, placeholder_grid, tower_grid
from dflop_ds.models.hf.base.vision import GridEncoderInputs
from dflop_ds.models.hf.base.visual_merge import VisualMerge

MODEL_TYPE = "qwen2_vl"
#: model types this adapter runs -> their HF model class
MODEL_CLASSES = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}

VisTuple = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def check_qwen2_vl_config(config: Any, where: str = "model") -> None:
    """Refuse a config this adapter cannot run, naming ``where``."""
    if getattr(config, "model_type", None) not in MODEL_CLASSES:
        raise ValueError(
            f"{where}: model type {getattr(config, 'model_type', None)!r} is not supported by the "
            f"Qwen2-VL adapter (supported: {', '.join(map(repr, MODEL_CLASSES))})"
        )
    layer_mask_kinds(config.text_config)  # refuses unknown attention kinds by name


def load_qwen2_vl(model_dir: str | Path, *, dtype: torch.dtype | None = None) -> Any:
    """Load a ``save_pretrained`` Qwen2-VL / Qwen2.5-VL directory as its ``...ForConditionalGeneration`` (offline)."""
    import transformers

    return load_checked(
        model_dir, check_qwen2_vl_config, lambda config: getattr(transformers, MODEL_CLASSES[config.model_type]), dtype
    )


def window_index(grid: torch.Tensor, vision_config: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(window_index, cu_window_seqlens)`` of Qwen2.5-VL's windowed tower (merge units in
    window order, window bounds in patches); ``None`` for a tower without windows (Qwen2-VL)."""
    if getattr(vision_config, "window_size", None) is None:
        return None
    from transformers.vision_utils import get_vision_window_index

    return get_vision_window_index(
        grid, int(vision_config.spatial_merge_size), int(vision_config.window_size), int(vision_config.patch_size)
    )


def permute_units(x: torch.Tensor, order: torch.Tensor, merge_size: int) -> torch.Tensor:
    """Rows of ``x [P, ...]`` reordered by merge unit (``merge**2`` consecutive patches) as ``order`` says."""
    unit = merge_size**2
    return x.reshape(x.shape[0] // unit, unit, *x.shape[1:])[order].reshape(x.shape)


class PatchEmbedding(nn.Module):
    """First encoder layer: ``pixel_values [P, C*T*p*p] -> vis [P, Dv]`` (the 3-D patch convolution).

    A microbatch without images embeds one blank placeholder image of grid ``[1, m, m]`` (its
    grid replaces the empty one), which the projector drops: the tower then runs the same
    operations with or without images, so every rank's backward produces the same gradients
    in the same order (as for LLaVA, see ``dflop_ds.models.hf.llava.model.VisionEmbeddings``).
    """

    def __init__(self, patch_embed: nn.Module, vision_config: Any) -> None:
        super().__init__()
        self.patch_embed = patch_embed
        self.vision_config = vision_config
        self.merge_size = int(vision_config.spatial_merge_size)

    def forward(self, inputs: VisTuple) -> VisTuple:
        """Embed every patch of the microbatch's images and videos (in window order for a windowed tower)."""
        pixel_values, input_ids, seq_lens, grid, video_grid = inputs
        if grid.shape[0] == 0 and video_grid.shape[0] == 0:
            grid = placeholder_grid(self.merge_size, grid)
            pixel_values = pixel_values.new_zeros((self.merge_size**2, pixel_values.shape[1]))
        vis = self.patch_embed(pixel_values)
        windows = window_index(tower_grid(grid, video_grid), self.vision_config)
        if windows is not None:
            vis = permute_units(vis, windows[0], self.merge_size)
        return vis, input_ids, seq_lens, grid, video_grid


class VisionBlock(nn.Module):
    """One vision block: attention within each image (``cu_seqlens``) with its 2-D rotary positions."""

    def __init__(self, block: nn.Module, rotary: nn.Module, vision_config: Any, index: int = 0) -> None:
        super().__init__()
        self.block = block
        self.rotary = rotary
        self.vision_config = vision_config
        self.full_attention = index in set(getattr(vision_config, "fullatt_block_indexes", None) or ())

    def forward(self, inputs: VisTuple) -> VisTuple:
        """Refine ``vis``; the segment bounds and rotary table come from the integer grid
        (windows and window order for a windowed tower's windowed blocks)."""
        from transformers.utils.generic import get_max_seqlen
        from transformers.vision_utils import get_vision_attention_seqlens, get_vision_position_ids

        vis, input_ids, seq_lens, image_grid, video_grid = inputs
        grid = tower_grid(image_grid, video_grid)
        config = self.vision_config
        merge = int(config.spatial_merge_size)
        cu_seqlens, max_seqlen = get_vision_attention_seqlens(grid, config)
        cos, sin = self.rotary(vis, get_vision_position_ids(grid, merge))
        windows = window_index(grid, config)
        if windows is not None:
            order, cu_windows = windows
            cos, sin = permute_units(cos, order, merge), permute_units(sin, order, merge)
            if not self.full_attention:
                cu_seqlens, max_seqlen = cu_windows, get_max_seqlen(cu_windows, config)
        out = self.block(vis, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, position_embeddings=(cos, sin))
        return out, input_ids, seq_lens, image_grid, video_grid


class Qwen2VLProjector(nn.Module):
    """Patch merger, token embedding, the merge at ``<|image_pad|>``/``<|video_pad|>`` and the M-RoPE
    positions: ``(vis, input_ids, seq_lens, image_grid, video_grid) -> (hidden [B, S, D], position_ids
    [3, B, S], seq_lens)``.

    The merged features of the microbatch's images, in order, replace the embeddings of the
    image tokens in row-major order, those of its videos the video tokens'. A microbatch without
    images and videos brings the tower's placeholder image, whose one feature is dropped here
    (sliced off, so the graph stays the same). A packed microbatch (``input_ids [1, sum(seq_lens)]``)
    gives ``hidden [1, N, D]`` and positions restarting at every sample.
    """

    def __init__(self, merger: nn.Module, embed_tokens: nn.Module, config: Any, tied_key: str | None = None) -> None:
        super().__init__()
        self.merger = merger
        self.embed_tokens = embed_tokens
        self.visual = VisualMerge(config, type(self).__name__)
        self.vision_config = config.vision_config
        self.tied_weights = {} if tied_key is None else {tied_key: "embed_tokens.weight"}

    def forward(self, inputs: VisTuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Merge image and video features into the token embeddings and compute the 3-D positions."""
        vis, input_ids, seq_lens, grid, video_grid = inputs
        if video_grid.shape[0] and getattr(self.vision_config, "window_size", None) is not None:
            raise ValueError(
                "Qwen2VLProjector: videos are not supported for Qwen2.5-VL yet (its temporal positions "
                "need the seconds per frame pair)"
            )
        features, grid, image_positions, video_positions = self.visual.split(
            input_ids, self.merger(vis), grid, video_grid
        )
        windows = window_index(grid, self.vision_config) if grid.shape[0] else None
        if windows is not None:  # back from window order to the images' own order
            features = features[torch.argsort(windows[0])]
        hidden = self.visual.scatter(self.embed_tokens(input_ids), features, image_positions, video_positions)
        position_ids = self.visual.positions(input_ids, seq_lens, grid, video_grid)
        return hidden, position_ids, seq_lens


class MRopeDecoderLayer(DecoderLayer):
    """One decoder layer at the M-RoPE positions: ``(hidden, position_ids [3, B, S], seq_lens) -> same``
    (padded rows or one packed row, as :class:`~dflop_ds.models.hf.base.layers.DecoderLayer`)."""

    def forward(self, inputs):
        """Apply the layer: attention masked by ``seq_lens``, rotary from ``position_ids``."""
        hidden, position_ids, seq_lens = inputs
        return self.attend(hidden, seq_lens, position_ids, None), position_ids, seq_lens


def qwen2_vl_layers(model: Any) -> tuple[list[nn.Module], nn.Module, list[nn.Module]]:
    """``(encoder_layers, projector, llm_layers)`` of a ``Qwen2VLForConditionalGeneration``, sharing its weights.

    With tied word embeddings the projector's ``embed_tokens`` and the head's ``lm_head`` declare
    the same :data:`TIED_EMBEDDING_KEY`, which ``MLLMPipelineModule`` keeps equal across stages.
    """
    config = model.config
    check_qwen2_vl_config(config, type(model).__name__)
    visual, language_model = model.model.visual, model.model.language_model
    vision_config = config.vision_config
    encoder: list[nn.Module] = [PatchEmbedding(visual.patch_embed, vision_config)]
    encoder += [VisionBlock(block, visual.rotary_pos_emb, vision_config, i) for i, block in enumerate(visual.blocks)]
    key = tied_embedding_key(model.lm_head, language_model)
    projector = Qwen2VLProjector(visual.merger, language_model.embed_tokens, config, tied_key=key)
    text_config = language_model.config
    kinds = layer_mask_kinds(text_config)
    llm: list[nn.Module] = [
        MRopeDecoderLayer(layer, language_model.rotary_emb, text_config, kind)
        for layer, kind in zip(language_model.layers, kinds)
    ]
    llm.append(LMHead(language_model.norm, model.lm_head, tied_key=key))
    return encoder, projector, llm


#: Profiler input factory of the first encoder layer (:class:`~dflop_ds.models.hf.base.vision.GridEncoderInputs`).
Qwen2VLEncoderInputs = GridEncoderInputs


class MRopeLLMInputs:
    """Profiler input factory of the first decoder layer: ``(batch, seq_len) -> (hidden,
    position_ids [3, B, S] (text positions), seq_lens)``."""

    def __init__(self, hidden_size: int, dtype: torch.dtype = torch.float32) -> None:
        self.hidden_size, self.dtype = int(hidden_size), dtype

    def __call__(self, batch: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        seq_lens = torch.full((batch,), seq_len, dtype=torch.long)
        hidden = torch.randn(batch, seq_len, self.hidden_size, dtype=self.dtype)
        return hidden, torch.arange(seq_len).expand(3, batch, seq_len).clone(), seq_lens


__all__ = [
    "MODEL_CLASSES",
    "MODEL_TYPE",
    "MRopeDecoderLayer",
    "MRopeLLMInputs",
    "PatchEmbedding",
    "Qwen2VLEncoderInputs",
    "Qwen2VLProjector",
    "TIED_EMBEDDING_KEY",
    "VisionBlock",
    "check_qwen2_vl_config",
    "is_placeholder",
    "load_qwen2_vl",
    "mrope_position_ids",
    "permute_units",
    "placeholder_grid",
    "qwen2_vl_layers",
    "tower_grid",
    "window_index",
]
