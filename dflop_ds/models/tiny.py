"""A tiny multimodal LLM (ViT over tiles + projector/merge + decoder LM) as flat pipeline layers.

Every layer maps a tuple of tensors to a tuple of tensors following the microbatch contract of
``docs/architecture.md`` (floating-point tensors first, integer tensors after them):

* encoder layers: ``(vis, input_ids, text_lens, tiles_per_sample) -> same layout``;
  :class:`PatchEmbed` turns ``pixels [T, C, P, P]`` into ``vis [T, N, Dv]``, each
  :class:`VisionBlock` refines it;
* :class:`Projector`: ``(vis, input_ids, text_lens, tiles_per_sample) -> (hidden, seq_lens)``,
  each sample's sequence being ``[visual tokens of its tiles] + [text tokens]``, right-padded;
* :class:`DecoderBlock`: ``(hidden, seq_lens) -> (hidden, seq_lens)``, causal attention with
  key padding, or per sample when the microbatch is packed (:mod:`dflop_ds.models.packing`:
  ``input_ids [1, sum(text_lens)]`` from the collate gives ``hidden [1, sum(seq_lens), D]``);
* :class:`LMHead`: ``(hidden, seq_lens) -> logits [B, S, V]``.

The attention is real (``scaled_dot_product_attention``), so the encoder cost grows with tiles
and the LLM cost with sequence length, quadratically in attention, as in a full-size MLLM.
Each layer can be initialized from its own seed, so a layer is identical whichever pipeline
stage builds it (the key to comparing a pipeline run with a single-process reference).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflop_ds.models.packing import check_packed, is_packed, segment_causal_attention, segment_positions
from dflop_ds.shapes import TINY_POLICY

VisTuple = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
LLMTuple = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class TinyMLLMConfig:
    """Sizes of the tiny MLLM.

    A tile of ``image_size x image_size`` pixels is cut into ``(image_size / patch_size)**2``
    patches; the projector pools ``pool x pool`` neighbouring patches, so a tile becomes
    ``tokens_per_tile`` LLM tokens (16 by default, :data:`dflop_ds.shapes.TINY_POLICY`'s value).
    """

    image_size: int = 32
    channels: int = 3
    patch_size: int = 4
    pool: int = 2
    vision_dim: int = 64
    vision_layers: int = 4
    vision_heads: int = 4
    llm_dim: int = 128
    llm_layers: int = 4
    llm_heads: int = 4
    vocab_size: int = 512
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")
        if self.patches_per_side % self.pool:
            raise ValueError(f"patch grid {self.patches_per_side} is not a multiple of pool {self.pool}")
        for dim, heads, name in ((self.vision_dim, self.vision_heads, "vision"), (self.llm_dim, self.llm_heads, "llm")):
            if dim % heads:
                raise ValueError(f"{name}_dim {dim} is not a multiple of {name}_heads {heads}")

    @property
    def patches_per_side(self) -> int:
        """Patches along one side of a tile."""
        return self.image_size // self.patch_size

    @property
    def patches_per_tile(self) -> int:
        """Vision-encoder tokens of one tile."""
        return self.patches_per_side**2

    @property
    def tokens_per_tile(self) -> int:
        """LLM tokens of one tile, after pooling."""
        return (self.patches_per_side // self.pool) ** 2


DEFAULT_CONFIG = TinyMLLMConfig()
assert DEFAULT_CONFIG.tokens_per_tile == TINY_POLICY.tokens_per_tile, "tiny model and TINY_POLICY disagree"
assert DEFAULT_CONFIG.tokens_per_tile == TINY_POLICY.tokens_per_frame, "tiny model and TINY_POLICY disagree"


def _seeded_init(module: nn.Module, init_seed: int | None, build: Callable[[], None]) -> None:
    """Run ``build`` (which creates ``module``'s parameters) under ``init_seed`` if given."""
    if init_seed is None:
        build()
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(init_seed))
        build()


def sinusoidal_positions(length: int, dim: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Fixed sinusoidal position table ``[length, dim]`` (no parameters, any length)."""
    pos = torch.arange(length, device=device, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, device=device, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim, device=device, dtype=torch.float32)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq)
    return table.to(dtype)


class Attention(nn.Module):
    """Multi-head self-attention over ``[B, L, D]`` with an optional boolean mask."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None = None, segments: list[int] | None = None
    ) -> torch.Tensor:
        """``mask`` is ``[B, 1, L, L]`` with True where a query may attend a key; with ``segments``
        (lengths of the samples packed in ``x [1, L, D]``) attention is causal inside each one."""
        b, length, dim = x.shape
        q, k, v = self.qkv(x).view(b, length, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        if segments is None:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            y = segment_causal_attention(q, k, v, segments)
        return self.out(y.transpose(1, 2).reshape(b, length, dim))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_ratio * dim), nn.GELU(), nn.Linear(mlp_ratio * dim, dim))

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None = None, segments: list[int] | None = None
    ) -> torch.Tensor:
        """Apply the block; ``mask`` and ``segments`` as in :class:`Attention`."""
        x = x + self.attn(self.norm1(x), mask, segments)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """First encoder layer: pixels ``[T, C, P, P]`` -> patch features ``[T, N, Dv]``."""

    def __init__(self, config: TinyMLLMConfig = DEFAULT_CONFIG, init_seed: int | None = None) -> None:
        super().__init__()
        self.config = config

        def build() -> None:
            patch_pixels = config.channels * config.patch_size**2
            self.proj = nn.Linear(patch_pixels, config.vision_dim)
            self.pos = nn.Parameter(0.02 * torch.randn(config.patches_per_tile, config.vision_dim))

        _seeded_init(self, init_seed, build)

    def forward(self, inputs: VisTuple) -> VisTuple:
        """Embed every tile's patches; a microbatch without tiles gives ``[0, N, Dv]``."""
        pixels, input_ids, text_lens, tiles_per_sample = inputs
        c = self.config
        t = pixels.shape[0]
        g, p = c.patches_per_side, c.patch_size
        patches = pixels.reshape(t, c.channels, g, p, g, p).permute(0, 2, 4, 1, 3, 5)
        patches = patches.reshape(t, g * g, c.channels * p * p)
        return self.proj(patches) + self.pos, input_ids, text_lens, tiles_per_sample


class VisionBlock(nn.Module):
    """Encoder transformer layer over each tile's patches (bidirectional attention)."""

    def __init__(self, config: TinyMLLMConfig = DEFAULT_CONFIG, init_seed: int | None = None) -> None:
        super().__init__()

        def build() -> None:
            self.block = Block(config.vision_dim, config.vision_heads, config.mlp_ratio)

        _seeded_init(self, init_seed, build)

    def forward(self, inputs: VisTuple) -> VisTuple:
        """Refine ``vis [T, N, Dv]``; the integer tensors pass through."""
        vis, input_ids, text_lens, tiles_per_sample = inputs
        return self.block(vis), input_ids, text_lens, tiles_per_sample


def merged_positions(
    text_lens: torch.Tensor, tiles_per_sample: torch.Tensor, tokens_per_tile: int, packed: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Where visual and text tokens go in the merged batch (flattened): right-padded ``[B, S]``,
    or one packed row ``[1, S]`` with ``S = sum(seq_lens)`` when ``packed``.

    Returns ``(visual_index, text_index, seq_lens, S)``: ``visual_index[k]`` is the flat position
    of the k-th visual token (tiles in sample order), ``text_index`` the flat positions of the
    valid text tokens in sample order. Sample ``i``'s sequence is its
    ``tiles * tokens_per_tile`` visual tokens followed by its ``text_lens[i]`` text tokens.
    """
    vis_lens = tiles_per_sample.to(torch.long) * tokens_per_tile
    text_lens = text_lens.to(torch.long)
    seq_lens = vis_lens + text_lens
    if packed:
        starts, s = torch.cumsum(seq_lens, 0) - seq_lens, int(seq_lens.sum().item())
    else:
        s = int(seq_lens.max().item()) if seq_lens.numel() else 0
        starts = torch.arange(seq_lens.numel(), device=seq_lens.device) * s
    vis_rows, vis_offsets = segment_positions(vis_lens)
    txt_rows, txt_offsets = segment_positions(text_lens)
    visual_index = starts[vis_rows] + vis_offsets
    text_index = starts[txt_rows] + vis_lens[txt_rows] + txt_offsets
    return visual_index, text_index, seq_lens, s


class Projector(nn.Module):
    """Pool + MLP over visual features, text embedding, and the merge into one LLM sequence."""

    def __init__(self, config: TinyMLLMConfig = DEFAULT_CONFIG, init_seed: int | None = None) -> None:
        super().__init__()
        self.config = config

        def build() -> None:
            dv, d = config.vision_dim, config.llm_dim
            self.norm = nn.LayerNorm(dv)
            self.mlp = nn.Sequential(nn.Linear(dv, d), nn.GELU(), nn.Linear(d, d))
            self.embed = nn.Embedding(config.vocab_size, d)

        _seeded_init(self, init_seed, build)

    def pool(self, vis: torch.Tensor) -> torch.Tensor:
        """Average ``pool x pool`` neighbouring patches: ``[T, N, Dv] -> [T, tokens_per_tile, Dv]``."""
        c = self.config
        t, g, k = vis.shape[0], c.patches_per_side, c.pool
        grid = vis.reshape(t, g // k, k, g // k, k, vis.shape[-1])
        return grid.mean(dim=(2, 4)).reshape(t, c.tokens_per_tile, vis.shape[-1])

    def forward(self, inputs: VisTuple) -> LLMTuple:
        """Build ``(hidden [B, S, D], seq_lens [B])`` with visual tokens first in each sample;
        packed text ``input_ids [1, sum(text_lens)]`` gives a packed ``hidden [1, sum(seq_lens), D]``
        whose positions restart at every sample."""
        vis, input_ids, text_lens, tiles_per_sample = inputs
        c = self.config
        if int(tiles_per_sample.sum().item()) != vis.shape[0]:
            raise ValueError(
                f"Projector: tiles_per_sample sums to {int(tiles_per_sample.sum())} but vis holds {vis.shape[0]} tiles"
            )
        visual = self.mlp(self.norm(self.pool(vis))).reshape(-1, c.llm_dim)
        b, s_text = input_ids.shape
        packed = is_packed(b, text_lens)
        visual_index, text_index, seq_lens, s = merged_positions(text_lens, tiles_per_sample, c.tokens_per_tile, packed)
        if packed:
            check_packed(b, s_text, text_lens, "Projector: packed input_ids")
            text = self.embed(input_ids[0])
            positions = segment_positions(seq_lens)[1]
        else:
            text_valid = torch.arange(s_text, device=input_ids.device)[None, :] < text_lens[:, None]
            text = self.embed(input_ids)[text_valid]
            positions = torch.arange(s, device=text.device)
        tokens = torch.cat([visual.to(text.dtype), text], dim=0)
        index = torch.cat([visual_index, text_index])
        rows = 1 if packed else b
        flat = torch.zeros(rows * s, c.llm_dim, device=text.device, dtype=text.dtype).index_copy(0, index, tokens)
        longest = int(seq_lens.max().item()) if packed else s
        table = sinusoidal_positions(longest, c.llm_dim, text.device, text.dtype)
        return flat.view(rows, s, c.llm_dim) + table[positions], seq_lens


def causal_padding_mask(seq_lens: torch.Tensor, length: int) -> torch.Tensor:
    """Boolean ``[B, 1, S, S]``: query ``q`` may attend key ``k`` iff ``k <= q`` and ``k`` is not padding."""
    pos = torch.arange(length, device=seq_lens.device)
    causal = pos[None, :] <= pos[:, None]
    key_valid = pos[None, :] < seq_lens[:, None]
    # padded query rows keep key 0 so that no row is fully masked (their outputs are ignored)
    mask = causal[None, :, :] & key_valid[:, None, :]
    mask[:, :, 0] = True
    return mask[:, None, :, :]


class DecoderBlock(nn.Module):
    """LLM transformer layer: causal self-attention with key padding, then an MLP."""

    def __init__(self, config: TinyMLLMConfig = DEFAULT_CONFIG, init_seed: int | None = None) -> None:
        super().__init__()

        def build() -> None:
            self.block = Block(config.llm_dim, config.llm_heads, config.mlp_ratio)

        _seeded_init(self, init_seed, build)

    def forward(self, inputs: LLMTuple) -> LLMTuple:
        """Refine ``hidden [B, S, D]`` (or packed ``[1, sum(seq_lens), D]``); ``seq_lens`` passes through."""
        hidden, seq_lens = inputs
        if is_packed(hidden.shape[0], seq_lens):
            check_packed(hidden.shape[0], hidden.shape[1], seq_lens, "DecoderBlock: packed hidden")
            return self.block(hidden, segments=seq_lens.tolist()), seq_lens
        mask = causal_padding_mask(seq_lens, hidden.shape[1])
        return self.block(hidden, mask), seq_lens


class LMHead(nn.Module):
    """Final norm and vocabulary projection: ``(hidden, seq_lens) -> logits [B, S, V]``."""

    def __init__(self, config: TinyMLLMConfig = DEFAULT_CONFIG, init_seed: int | None = None) -> None:
        super().__init__()

        def build() -> None:
            self.norm = nn.LayerNorm(config.llm_dim)
            self.proj = nn.Linear(config.llm_dim, config.vocab_size)

        _seeded_init(self, init_seed, build)

    def forward(self, inputs: LLMTuple) -> torch.Tensor:
        """Logits at every position (padding included; the loss ignores it)."""
        hidden, _seq_lens = inputs
        return self.proj(self.norm(hidden))


def tiny_mllm_layers(
    config: TinyMLLMConfig = DEFAULT_CONFIG, *, seed: int = 0, as_specs: bool = True
) -> tuple[list, Any, list]:
    """The tiny MLLM as ``(encoder_layers, projector, llm_layers)``.

    ``encoder_layers`` is ``[PatchEmbed, VisionBlock x vision_layers]``; ``llm_layers`` is
    ``[DecoderBlock x llm_layers, LMHead]``. With ``as_specs`` the entries are DeepSpeed
    ``LayerSpec`` objects (each pipeline stage builds only its own layers), else built modules.
    Layer ``i`` of the flat list is initialized from seed ``seed * 10007 + i`` either way, so
    specs and modules give identical weights.
    """
    classes: list[type[nn.Module]] = [PatchEmbed] + [VisionBlock] * config.vision_layers
    classes += [Projector] + [DecoderBlock] * config.llm_layers + [LMHead]
    if as_specs:
        from deepspeed.pipe import LayerSpec

        made = [LayerSpec(cls, config, init_seed=seed * 10007 + i) for i, cls in enumerate(classes)]
    else:
        made = [cls(config, init_seed=seed * 10007 + i) for i, cls in enumerate(classes)]
    n_enc = 1 + config.vision_layers
    return made[:n_enc], made[n_enc], made[n_enc + 1 :]


def build_reference(config: TinyMLLMConfig = DEFAULT_CONFIG, *, seed: int = 0) -> nn.Sequential:
    """All layers of :func:`tiny_mllm_layers` as one ``nn.Sequential`` (single-process reference).

    Its child ``str(i)`` holds flat layer ``i``, the same naming a ``PipelineModule`` uses, so
    parameters can be compared by name.
    """
    encoder, projector, llm = tiny_mllm_layers(config, seed=seed, as_specs=False)
    return nn.Sequential(*encoder, projector, *llm)
