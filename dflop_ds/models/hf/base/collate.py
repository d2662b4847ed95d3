"""The padded and packed collates of the HF microbatch contract, for every family's items."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dflop_ds.models.hf.base.dataset import MediaItem
from dflop_ds.models.packing import join_rows
from dflop_ds.models.tiny_data import IGNORE_INDEX, microbatch_denominator


def collate_padded(
    items: Sequence[MediaItem], packed: bool = False
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, torch.Tensor]]:
    """One microbatch as the contract's ``((pixel_values, input_ids, seq_lens), (targets, loss_denominator))``.

    ``input_ids`` are right-padded with the tokenizer's pad id, ``targets`` with -100; with
    ``packed`` both are one row ``[1, sum(seq_lens)]`` of the samples one after another
    (:mod:`dflop_ds.models.packing`). The denominator is the scheduled one, or the microbatch's
    own target count for plain indices.
    """
    if not items:
        raise ValueError("collate_padded: empty microbatch")
    pads = {item.pad_token_id for item in items}
    if len(pads) > 1:
        raise ValueError(f"collate_padded: items of different tokenizers (pad ids {sorted(pads)})")
    seq_lens = torch.tensor([item.input_ids.numel() for item in items], dtype=torch.long)
    input_ids = join_rows([item.input_ids for item in items], pads.pop(), packed)
    targets = join_rows([item.targets for item in items], IGNORE_INDEX, packed)
    pixel_values = torch.cat([item.pixel_values for item in items], dim=0)
    denominator = torch.tensor(microbatch_denominator(items), dtype=torch.float64)
    return (pixel_values, input_ids, seq_lens), (targets, denominator)


def collate_packed(
    items: Sequence[MediaItem],
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, torch.Tensor]]:
    """:func:`collate_padded` with ``packed=True`` (a picklable collate for DataLoader workers)."""
    return collate_padded(items, packed=True)


__all__ = ["collate_padded", "collate_packed"]
