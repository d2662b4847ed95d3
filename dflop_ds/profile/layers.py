"""Which layers of a segment to profile, and how much of the full depth each one stands for.

A segment is a flat list of pipeline layers: a few distinct ones (patch embedding, projector,
head) and many identical blocks. DFLOP profiles a few blocks and scales to the full depth; we
do the same: the most frequent layer class is the block, its first ``max_blocks`` instances
are profiled and each stands for ``n_blocks / profiled`` blocks; every other layer is profiled
once with weight 1.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ProfiledLayer:
    """One layer the profiler runs: its position, class name and weight in the full depth."""

    index: int
    name: str
    weight: float


def select_layers(layers: Sequence[torch.nn.Module], max_blocks: int) -> list[ProfiledLayer]:
    """The layers to profile, in order, with weights summing to ``len(layers)``.

    Raises ``ValueError`` for an empty segment or ``max_blocks < 1``.
    """
    if not layers:
        raise ValueError("cannot profile an empty list of layers")
    if max_blocks < 1:
        raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
    names = [type(layer).__name__ for layer in layers]
    block, count = Counter(names).most_common(1)[0]
    if count == 1:
        return [ProfiledLayer(i, name, 1.0) for i, name in enumerate(names)]
    profiled_blocks = min(max_blocks, count)
    weight = count / profiled_blocks
    chosen: list[ProfiledLayer] = []
    seen_blocks = 0
    for i, name in enumerate(names):
        if name != block:
            chosen.append(ProfiledLayer(i, name, 1.0))
        elif seen_blocks < profiled_blocks:
            chosen.append(ProfiledLayer(i, name, weight))
            seen_blocks += 1
    return chosen


def describe_selection(segment: str, selection: Sequence[ProfiledLayer], total: int) -> str:
    """A one-line account of what was profiled and how it was scaled, for the output."""
    parts = []
    for name in dict.fromkeys(p.name for p in selection):
        group = [p for p in selection if p.name == name]
        represented = sum(p.weight for p in group)
        scale = f" x{group[0].weight:g}" if group[0].weight != 1 else ""
        parts.append(f"{len(group)} of {represented:g} {name}{scale}")
    return f"{segment}: profiled {', '.join(parts)} (full depth {total} layers)"


def parameter_bytes(modules: Sequence[torch.nn.Module]) -> int:
    """Bytes of the parameters of ``modules`` (shared parameters counted once)."""
    seen: set[int] = set()
    total = 0
    for module in modules:
        for param in module.parameters():
            if id(param) not in seen:
                seen.add(id(param))
                total += param.numel() * param.element_size()
    return total
