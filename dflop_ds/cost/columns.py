"""A batch's microbatches, flat, with the per-sample numbers their costs depend on.

:class:`SampleColumns` holds a batch's per-sample tiles, LLM tokens, attention units and visual
tokens as arrays; :class:`Microbatches` holds its microbatches as one flat array of positions with
their sizes, and gives each microbatch's sums and maxima of a per-sample column in one call. The
batched cost predictions (:mod:`dflop_ds.cost.batched`) take them.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from dflop_ds.shapes import SampleShape


@dataclass(frozen=True)
class SampleColumns:
    """The per-sample numbers of ``shapes`` a microbatch's cost depends on, as arrays."""

    shapes: Sequence[SampleShape]
    tiles: np.ndarray  # encoder tiles
    tokens: np.ndarray  # LLM tokens (the sequence length)
    attention: np.ndarray  # encoder attention units
    visual: np.ndarray  # visual tokens the projector inserts

    @classmethod
    def of(cls, batch: Sequence[SampleShape] | SampleColumns) -> SampleColumns:
        """The columns of ``batch``'s shapes (integer arrays, as the shapes hold them); columns
        already made are returned as they are."""
        if isinstance(batch, SampleColumns):
            return batch
        shapes, n = batch, len(batch)
        return cls(
            shapes,
            tiles=np.array([s.encoder_tiles for s in shapes]).reshape(n),
            tokens=np.array([s.llm_tokens for s in shapes]).reshape(n),
            attention=np.array([s.encoder_attention for s in shapes]).reshape(n),
            visual=np.array([s.visual_tokens for s in shapes]).reshape(n),
        )


@dataclass(frozen=True)
class Microbatches:
    """Microbatches of one batch, flat: microbatch ``j`` holds the samples at positions
    ``items[starts[j]:starts[j] + sizes[j]]`` of ``columns.shapes``."""

    columns: SampleColumns
    items: np.ndarray  # (total,) int positions, microbatch after microbatch
    sizes: np.ndarray  # (n,) samples in each microbatch

    @classmethod
    def of(cls, batch: Sequence[SampleShape] | SampleColumns, groups: Sequence[Sequence[int]]) -> Microbatches:
        """The microbatches ``groups`` (lists of positions) of ``batch`` (shapes, or their columns)."""
        columns = SampleColumns.of(batch)
        sizes = np.fromiter(map(len, groups), dtype=np.int64, count=len(groups))
        items = np.fromiter(itertools.chain.from_iterable(groups), dtype=np.int64, count=int(sizes.sum()))
        return cls(columns, items, sizes)

    @classmethod
    def singletons(cls, batch: Sequence[SampleShape] | SampleColumns) -> Microbatches:
        """Every sample of ``batch`` a microbatch of its own, in order."""
        columns = SampleColumns.of(batch)
        n = len(columns.shapes)
        return cls(columns, np.arange(n, dtype=np.int64), np.ones(n, dtype=np.int64))

    def __len__(self) -> int:
        return len(self.sizes)

    @cached_property
    def starts(self) -> np.ndarray:
        """``(n,)`` where each microbatch begins in :attr:`items`."""
        return np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64) if len(self.sizes) else self.sizes

    @cached_property
    def filled(self) -> np.ndarray:
        """``(n,)`` True where a microbatch holds samples."""
        return self.sizes > 0

    def sums(self, per_sample: np.ndarray) -> np.ndarray:
        """``(n, ...)``: each microbatch's sum of ``per_sample`` (rows by position in the batch; 0 when empty)."""
        return self._reduce(np.add, per_sample)

    def maxima(self, per_sample: np.ndarray) -> np.ndarray:
        """``(n, ...)``: each microbatch's largest ``per_sample`` (0 when empty)."""
        return self._reduce(np.maximum, per_sample)

    def _reduce(self, ufunc: np.ufunc, per_sample: np.ndarray) -> np.ndarray:
        values = np.asarray(per_sample)[self.items]
        out = np.zeros((len(self.sizes),) + values.shape[1:], dtype=values.dtype)
        if self.filled.all():
            return ufunc.reduceat(values, self.starts, axis=0) if len(out) else out
        if self.filled.any():  # an empty microbatch would take its neighbour's first sample
            out[self.filled] = ufunc.reduceat(values, self.starts[self.filled], axis=0)
        return out

    def shape_lists(self) -> list[list[SampleShape]]:
        """The microbatches as lists of shapes (what the per-microbatch predictions take)."""
        shapes = self.columns.shapes
        flat = [shapes[i] for i in self.items.tolist()]
        bounds = np.concatenate([self.starts, [len(flat)]]).tolist() if len(self.sizes) else [0]
        return [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
