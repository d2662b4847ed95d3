"""HF ``Qwen3VLForConditionalGeneration`` as the pipeline's flat layer lists (docs/architecture.md).

Microbatch inputs: ``(pixel_values [P, C*T*p*p], input_ids [B, S], seq_lens [B], image_grid_thw [N, 3],
video_grid_thw [V, 3])``: every image's patches, flattened as Qwen3-VL's image processor writes them
(patch 16, temporal patch 2, merge 2 on the released checkpoints), images in microbatch order, then
every video's (Qwen2-VL's layout: pairs of frames on the temporal axis of each patch); every image's
``<|image_pad|>`` token already repeated ``t*h*w / merge**2`` times, and every video written as its
processor writes it: per frame group ``<t seconds>``, ``<|vision_start|>``, ``h*w / merge**2``
``<|video_pad|>`` tokens, ``<|vision_end|>``. A microbatch without images has ``N = 0``, without
videos ``V = 0``. The tower and the positions take a video as ``t`` one-frame-group images
(:func:`frame_grids`), as HF does.

:func:`qwen3_vl_layers` turns a loaded model into ``(encoder_layers, projector, llm_layers)``:

* encoder: :class:`PatchEmbedding` (the 3-D patch convolution plus the learned position table
  resampled to each image's grid; a microbatch without images embeds one placeholder image), then
  one :class:`VisionBlock` per vision block. ``(vis [P, Dv], deep [k*P/m**2, D], input_ids,
  seq_lens, image_grid, frame_grid)`` (``frame_grid``: the videos' frame groups, one row each). A
  block listed in ``deepstack_visual_indexes`` also runs its deepstack merger on its output and
  appends the result to ``deep`` (flat, one ``[P/m**2, D]`` chunk per deepstack block, in block
  order), so the features travel as one floating-point tensor with its grad history across any
  stage boundary.
* projector: :class:`Qwen3VLProjector`: the patch merger, token embedding, the features written at
  the ``<|image_pad|>`` and ``<|video_pad|>`` tokens and the interleaved M-RoPE position ids
  (:func:`mrope_position_ids`):
  ``-> (hidden [B, S, D], deep [K*n, D], position_ids [3, B, S], seq_lens, visual_index [n])``
  (``visual_index``: the flat row-major positions of the ``n`` image tokens, then of the video
  tokens: the tower's order).
* LLM: one :class:`DeepstackDecoderLayer` per decoder layer (decoder layer ``j < K`` adds chunk ``j``
  of ``deep`` at ``visual_index`` after the layer, as HF does, and passes the rest on; the layer
  that adds the last chunk drops ``deep`` and ``visual_index``), then the shared
  :class:`~dflop_ds.models.hf.base.layers.LMHead`.

Packed microbatches: ``input_ids [1, sum(seq_lens)]``; the projector gives each sample its own M-RoPE
positions (restarting at 0), the decoder layers attend within each sample, and ``visual_index`` is
row-major either way, so packed equals padded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflop_ds.models.hf.base.layers import (
    DecoderLayer,
    LMHead,
    layer_mask_kinds,
    load_checked,
    tied_embedding_key,
)
from dflop_ds.models.hf.base.mrope import mrope_position_ids, placeholder_grid, tower_grid
from dflop_ds.models.hf.base.vision import GridEncoderInputs
from dflop_ds.models.hf.base.visual_merge import VisualMerge

MODEL_TYPE = "qwen3_vl"
MODEL_CLASS = "Qwen3VLForConditionalGeneration"

VisTuple = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def frame_grids(video_grid: torch.Tensor) -> torch.Tensor:
    """``[sum t, 3]``: each video's ``(t, h, w)`` grid as ``t`` rows ``(1, h, w)``, one per frame group
    (how Qwen3-VL's positions take a video, its timestamps written between the groups)."""
    frames = torch.repeat_interleave(video_grid, video_grid[:, 0], dim=0)
    frames[:, 0] = 1
    return frames


def check_qwen3_vl_config(config: Any, where: str = "model") -> None:
    """Refuse a config this adapter cannot run, naming ``where``."""
    if getattr(config, "model_type", None) != MODEL_TYPE:
        raise ValueError(
            f"{where}: model type {getattr(config, 'model_type', None)!r} is not supported by the "
            f"Qwen3-VL adapter (supported: {MODEL_TYPE!r})"
        )
    layer_mask_kinds(config.text_config)  # refuses unknown attention kinds by name
    deepstack = len(config.vision_config.deepstack_visual_indexes)
    if deepstack > int(config.text_config.num_hidden_layers):
        raise ValueError(
            f"{where}: {deepstack} deepstack features but only {config.text_config.num_hidden_layers} decoder layers"
        )


def load_qwen3_vl(model_dir: str | Path, *, dtype: torch.dtype | None = None) -> Any:
    """Load a ``save_pretrained`` Qwen3-VL directory as its ``Qwen3VLForConditionalGeneration`` (offline)."""
    import transformers

    return load_checked(model_dir, check_qwen3_vl_config, lambda config: getattr(transformers, MODEL_CLASS), dtype)


class PatchEmbedding(nn.Module):
    """First encoder layer: ``(pixel_values, input_ids, seq_lens, image_grid, video_grid) -> (vis [P, Dv],
    deep [0, D], input_ids, seq_lens, image_grid, frame_grid)``: the patch convolution plus the learned
    position table resampled to each image's and frame group's grid (as HF's tower resamples it, in
    merge-block order).

    A microbatch without images and videos embeds one blank placeholder image of grid ``[1, m, m]``, which the
    projector drops: the tower and the deepstack mergers then run the same operations with or
    without images, so every rank's backward produces the same gradients in the same order.
    """

    def __init__(self, visual: Any, out_hidden_size: int) -> None:
        super().__init__()
        self.patch_embed, self.pos_embed = visual.patch_embed, visual.pos_embed
        self.num_grid_per_side = int(visual.num_grid_per_side)
        self.mode, self.align_corners = str(visual.interpolation_mode), bool(visual.interpolation_align_corners)
        self.merge_size = int(visual.spatial_merge_size)
        self.out_hidden_size = int(out_hidden_size)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> VisTuple:
        """Embed every patch of the microbatch's images; ``deep`` starts empty (a view of ``vis``,
        so it has a grad history at any stage boundary)."""
        from transformers.vision_utils import get_vision_interpolation_indices_and_weights

        pixel_values, input_ids, seq_lens, grid, video_grid = inputs
        frames = frame_grids(video_grid)
        if grid.shape[0] == 0 and frames.shape[0] == 0:
            grid = placeholder_grid(self.merge_size, grid)
            pixel_values = pixel_values.new_zeros((self.merge_size**2, pixel_values.shape[1]))
        indices, weights = get_vision_interpolation_indices_and_weights(
            tower_grid(grid, frames),
            num_grid_per_side=self.num_grid_per_side,
            mode=self.mode,
            align_corners=self.align_corners,
            spatial_merge_size=self.merge_size,
        )
        vis = self.patch_embed(pixel_values)
        vis = vis + (self.pos_embed(indices) * weights[:, :, None]).sum(1).to(vis.dtype)
        deep = vis[:0, :1].expand(0, self.out_hidden_size)
        return vis, deep, input_ids, seq_lens, grid, frames


class VisionBlock(nn.Module):
    """One vision block: attention within each image with its 2-D rotary positions (both rebuilt
    from the integer grid); a deepstack block appends its merger's output to ``deep``."""

    def __init__(self, block: nn.Module, rotary: nn.Module, vision_config: Any, deepstack: nn.Module | None) -> None:
        super().__init__()
        self.block, self.rotary, self.vision_config, self.deepstack = block, rotary, vision_config, deepstack

    def forward(self, inputs: VisTuple) -> VisTuple:
        """Refine ``vis`` (and grow ``deep`` at a deepstack block)."""
        from transformers.vision_utils import get_vision_attention_seqlens, get_vision_position_ids

        vis, deep, input_ids, seq_lens, grid, frames = inputs
        config = self.vision_config
        tower = tower_grid(grid, frames)
        cu_seqlens, max_seqlen = get_vision_attention_seqlens(tower, config)
        cos, sin = self.rotary(vis, get_vision_position_ids(tower, int(config.spatial_merge_size)))
        out = self.block(vis, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, position_embeddings=(cos, sin))
        if self.deepstack is not None:
            deep = torch.cat([deep, self.deepstack(out).to(deep.dtype)])
        return out, deep, input_ids, seq_lens, grid, frames


class Qwen3VLProjector(nn.Module):
    """Patch merger, token embedding, the merge at ``<|image_pad|>`` and ``<|video_pad|>`` and the
    M-RoPE positions: ``(vis, deep, input_ids, seq_lens, image_grid, frame_grid) -> (hidden [B, S, D],
    deep [K*n, D], position_ids [3, B, S], seq_lens, visual_index [n])``, or ``(hidden, position_ids,
    seq_lens)`` for a tower without deepstack blocks.

    The merged features of the microbatch's images, in order, replace the embeddings of the image
    tokens in row-major order, then the videos' those of the video tokens; each deepstack chunk keeps
    the same order (``visual_index``: the image tokens' positions, then the video tokens'). The
    placeholder image of a microbatch without images and videos is sliced off (so the graph stays the same).
    """

    def __init__(self, merger: nn.Module, embed_tokens: nn.Module, config: Any, tied_key: str | None = None) -> None:
        super().__init__()
        self.merger = merger
        self.embed_tokens = embed_tokens
        self.visual = VisualMerge(config, type(self).__name__)
        self.deepstack = len(config.vision_config.deepstack_visual_indexes)
        self.tied_weights = {} if tied_key is None else {tied_key: "embed_tokens.weight"}

    def forward(self, inputs: VisTuple) -> tuple[torch.Tensor, ...]:
        """Merge image and video features into the token embeddings, order the deepstack chunks,
        compute the positions."""
        vis, deep, input_ids, seq_lens, grid, frames = inputs
        tower_tokens = vis.shape[0] // self.visual.merge_size**2
        features, grid, image_positions, video_positions = self.visual.split(input_ids, self.merger(vis), grid, frames)
        hidden = self.visual.scatter(self.embed_tokens(input_ids), features, image_positions, video_positions)
        position_ids = self.visual.positions(input_ids, seq_lens, grid, frames)
        if not self.deepstack:
            return hidden, position_ids, seq_lens
        width, n = deep.shape[-1], features.shape[0]
        deep = deep.reshape(self.deepstack, tower_tokens, width)[:, :n].reshape(self.deepstack * n, width)
        visual_index = torch.cat([image_positions.flatten().nonzero(), video_positions.flatten().nonzero()]).flatten()
        return hidden, deep.to(hidden.dtype), position_ids, seq_lens, visual_index


class DeepstackDecoderLayer(DecoderLayer):
    """One decoder layer at the M-RoPE positions. Layer ``j`` of the ``K`` deepstack layers takes
    ``(hidden, deep, position_ids, seq_lens, visual_index)``, adds the first ``n`` rows of ``deep`` at
    ``visual_index`` after the layer and passes the other rows on (the last one passes
    ``(hidden, position_ids, seq_lens)``); the others map ``(hidden, position_ids, seq_lens)`` to the same."""

    def __init__(
        self, layer: nn.Module, rotary_emb: nn.Module, text_config: Any, kind: str, index: int, deepstack: int
    ) -> None:
        super().__init__(layer, rotary_emb, text_config, kind)
        self.adds_deepstack = index < deepstack
        self.last_deepstack = index == deepstack - 1

    def forward(self, inputs):
        """Apply the layer (attention masked by ``seq_lens``, rotary from ``position_ids``) and its deepstack chunk."""
        if not self.adds_deepstack:
            hidden, position_ids, seq_lens = inputs
            return self.attend(hidden, seq_lens, position_ids, None), position_ids, seq_lens
        hidden, deep, position_ids, seq_lens, visual_index = inputs
        out = self.attend(hidden, seq_lens, position_ids, None)
        n = visual_index.numel()
        flat = out.reshape(-1, out.shape[-1]).index_add(0, visual_index, deep[:n].to(out.dtype))
        out = flat.view_as(out)
        if self.last_deepstack:
            return out, position_ids, seq_lens
        return out, deep[n:], position_ids, seq_lens, visual_index


def qwen3_vl_layers(model: Any) -> tuple[list[nn.Module], nn.Module, list[nn.Module]]:
    """``(encoder_layers, projector, llm_layers)`` of a ``Qwen3VLForConditionalGeneration``, sharing its weights.

    With tied word embeddings the projector's ``embed_tokens`` and the head's ``lm_head`` declare
    the same :data:`TIED_EMBEDDING_KEY`, which ``MLLMPipelineModule`` keeps equal across stages.
    """
    config = model.config
    check_qwen3_vl_config(config, type(model).__name__)
    visual, language_model = model.model.visual, model.model.language_model
    vision_config = config.vision_config
    indexes = list(vision_config.deepstack_visual_indexes)
    mergers = dict(zip(indexes, visual.deepstack_merger_list))
    encoder: list[nn.Module] = [PatchEmbedding(visual, int(vision_config.out_hidden_size))]
    encoder += [
        VisionBlock(block, visual.rotary_pos_emb, vision_config, mergers.get(i))
        for i, block in enumerate(visual.blocks)
    ]
    key = tied_embedding_key(model.lm_head, language_model)
    projector = Qwen3VLProjector(visual.merger, language_model.embed_tokens, config, tied_key=key)
    text_config = language_model.config
    kinds = layer_mask_kinds(text_config)
    llm: list[nn.Module] = [
        DeepstackDecoderLayer(layer, language_model.rotary_emb, text_config, kind, i, len(indexes))
        for i, (layer, kind) in enumerate(zip(language_model.layers, kinds))
    ]
    llm.append(LMHead(language_model.norm, model.lm_head, tied_key=key))
    return encoder, projector, llm


#: Profiler input factory of the first encoder layer (:class:`~dflop_ds.models.hf.base.vision.GridEncoderInputs`).
Qwen3VLEncoderInputs = GridEncoderInputs


class DeepstackLLMInputs:
    """Profiler input factory of the first decoder layer: ``(batch, seq_len) -> (hidden, deep [0, D],
    position_ids [3, B, S] (text positions), seq_lens, visual_index [0])`` (a text-only microbatch)."""

    def __init__(self, hidden_size: int, dtype: torch.dtype = torch.float32) -> None:
        self.hidden_size, self.dtype = int(hidden_size), dtype

    def __call__(self, batch: int, seq_len: int) -> tuple[torch.Tensor, ...]:
        seq_lens = torch.full((batch,), seq_len, dtype=torch.long)
        hidden = torch.randn(batch, seq_len, self.hidden_size, dtype=self.dtype)
        positions = torch.arange(seq_len).expand(3, batch, seq_len).clone()
        return hidden, hidden.new_zeros(0, self.hidden_size), positions, seq_lens, torch.zeros(0, dtype=torch.long)


__all__ = [
    "MODEL_CLASS",
    "MODEL_TYPE",
    "DeepstackDecoderLayer",
    "DeepstackLLMInputs",
    "PatchEmbedding",
    "Qwen3VLEncoderInputs",
    "Qwen3VLProjector",
    "VisionBlock",
    "check_qwen3_vl_config",
    "frame_grids",
    "load_qwen3_vl",
    "mrope_position_ids",
    "qwen3_vl_layers",
    "tower_grid",
]
