"""Costs under packing: a packed microbatch costs one per-microbatch overhead plus its samples' costs.

Packed, a microbatch has no padding: its linear layers run over its tokens and its attention over
each sample apart (:mod:`dflop_ds.models.packing`), so every term of the fitted cost that grows
with ``B``, ``B*S`` or ``B*S^2`` becomes a sum over its samples, and only the constant (the
per-microbatch overhead) is paid once. :class:`PackedCost` wraps any cost model whose padded
microbatch cost is linear in the batch (:class:`~dflop_ds.cost.FittedCostModel`,
:class:`~dflop_ds.cost.ProxyCost`, ...): a sample costs its marginal cost, a microbatch the
overhead plus the sum. Since every microbatch carries the same overhead, the partitioner's
objective is exactly additive (``additive = True`` tells the sampler to drop the padding-aware
microbatch cost).

Not every packer keeps attention inside each sample. LLaMA-Factory's ``packing`` (without
``neat_packing``) trains a row with one causal mask over all of it, and HF's SDPA and eager
attention run a packed row's block-diagonal mask as a dense ``N x N`` product. There the LLM pays
for one sequence of the row's ``N`` tokens: :class:`RowPackedCost` predicts that (not additive).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cached_property
from typing import Any

import numpy as np

from dflop_ds.cost.columns import Microbatches
from dflop_ds.cost.protocol import CostModel
from dflop_ds.shapes import SampleShape

#: row lengths whose LLM cost :class:`RowPackedCost` predicts together (the block of a missing one)
ROW_LENGTH_BLOCK = 128
#: one tile and one token: the smallest sample whose doubling isolates the per-microbatch constant
_PROBE = SampleShape("packing-overhead-probe", encoder_tiles=1, llm_tokens=1, text_tokens=1)


def microbatch_overhead(cost_model: CostModel) -> np.ndarray:
    """``(k,)`` per-microbatch constant of ``cost_model``: two one-sample microbatches minus one of
    both samples (no padding between equal samples), clamped at 0."""
    single = np.asarray(cost_model.predict_samples([_PROBE]), dtype=float).reshape(-1)
    return _constant(single, cost_model.predict_microbatch)


def _constant(single: np.ndarray, predict: Any) -> np.ndarray:
    """What a microbatch of two probes costs less than two of one: ``predict``'s per-microbatch constant."""
    pair = np.asarray(predict([_PROBE, _PROBE]), dtype=float).reshape(-1)
    return np.clip(2 * single - pair, 0.0, single)


class PackedCost:
    """``cost_model``'s predictions for packed microbatches (exactly additive plus one overhead).

    Saved as the wrapped model (:mod:`dflop_ds.cost.io` nests it); ``overhead_`` is derived from it.
    """

    kind = "packed"
    #: every microbatch carries the same overhead: the partitioner's objective is the sum
    additive = True

    def __init__(self, cost_model: CostModel) -> None:
        self.cost_model = cost_model
        # the wrapped model's columns and memory, packed
        self.per_stage = cost_model.per_stage
        self.memory_per_device = cost_model.memory_per_device
        self.predicts_memory = cost_model.predicts_memory
        self.is_analytic = cost_model.is_analytic

    @cached_property
    def overhead_(self) -> np.ndarray:
        """``(k,)`` the wrapped model's per-microbatch constant (:func:`microbatch_overhead`)."""
        return microbatch_overhead(self.cost_model)

    def predict_samples(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """``(n, k)`` marginal cost of each sample in a packed microbatch (0 where the sample has
        no work for a column, e.g. no tiles)."""
        alone = np.asarray(self.cost_model.predict_samples(shapes), dtype=float).reshape(len(shapes), -1)
        return np.maximum(alone - self.overhead_, 0.0)

    def predict_microbatch(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """``(k,)`` cost of one packed microbatch: the overhead plus the sum of its samples' costs
        (the overhead of every column: every layer runs, e.g. the encoder's on no tiles, as in
        the padded model's ``predict_microbatch``)."""
        if not shapes:
            return np.zeros_like(self.overhead_)
        return self.predict_samples(shapes).sum(axis=0) + self.overhead_

    def predict_microbatches(self, groups: Microbatches) -> np.ndarray:
        """``(n, k)`` :meth:`predict_microbatch` of each microbatch of ``groups``: the overhead plus
        the sum of its samples' marginal costs (zeros for an empty one)."""
        costs = np.zeros((len(groups), len(self.overhead_)))
        if groups.filled.any():
            summed = groups.sums(self.predict_samples(groups.columns.shapes)) + self.overhead_
            costs[groups.filled] = summed[groups.filled]
        return costs

    def predict_memory(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """``(k,)`` bytes of one packed microbatch: the wrapped model's per-microbatch constant plus
        each sample's bytes beyond it (a sample's activations do not grow with its neighbours')."""
        if not shapes:
            return np.zeros_like(self.overhead_)
        predict = self.cost_model.predict_memory
        alone = np.array([np.asarray(predict([s]), dtype=float).reshape(-1) for s in shapes])
        constant = _constant(np.asarray(predict([_PROBE]), dtype=float).reshape(-1), predict)
        return np.maximum(alone - constant, 0.0).sum(axis=0) + constant


def _row(tokens: int) -> SampleShape:
    """The one-sample row whose LLM cost a row-attention packed microbatch pays (all its tokens, no tiles)."""
    return SampleShape("packed-row", text_tokens=tokens, llm_tokens=tokens)


class RowPackedCost(PackedCost):
    """``cost_model``'s predictions for packed rows whose LLM attention spans the whole row.

    The encoder runs each sample's media apart, as under :class:`PackedCost`; the LLM runs the row
    as one sequence of all its tokens, so its column is the wrapped model's cost of one sample of
    that many tokens (linear work over the tokens, attention over their square). Not additive: a
    microbatch costs more than its samples' marginal costs, the more the longer its row. The LLM is
    the last column; a per-stage model is refused (the row has no per-stage split).
    """

    kind = "packed_row"
    #: a row's attention grows with the square of its length: the sampler scores true microbatch costs
    additive = False

    def __init__(self, cost_model: CostModel) -> None:
        if cost_model.per_stage:
            raise ValueError(
                f"{type(cost_model).__name__} predicts per pipeline stage; row-attention packing costs"
                " [encoder, llm] columns only"
            )
        super().__init__(cost_model)
        # a splitter asks for thousands of rows of a few dozen samples: each sample's marginal cost
        # and each row length's LLM cost are predicted once
        self._marginals: dict[SampleShape, np.ndarray] = {}
        self._rows: dict[int, float] = {}

    def row_llm(self, tokens: np.ndarray) -> np.ndarray:
        """``(n,)`` the wrapped model's LLM cost of one row of each of ``tokens`` tokens."""
        lengths = [int(t) for t in np.asarray(tokens).reshape(-1)]
        # not ``set(lengths) - self._rows.keys()``: that walks the whole cache on every call
        missing = {n for n in lengths if n not in self._rows}
        if missing:
            # the whole block of lengths around each missing one in one call: a splitter asks for
            # a few new lengths at a time, and a call costs far more than a length in it
            blocks = {n // ROW_LENGTH_BLOCK for n in missing if n > 0}
            block_lengths = (n for b in blocks for n in range(b * ROW_LENGTH_BLOCK, (b + 1) * ROW_LENGTH_BLOCK))
            new = sorted(missing | {n for n in block_lengths if n > 0 and n not in self._rows})
            costs = np.asarray(self.cost_model.predict_samples([_row(n) for n in new]), dtype=float)
            self._rows.update(zip(new, costs.reshape(len(new), -1)[:, -1].tolist()))
        return np.array([self._rows[n] for n in lengths], dtype=float)

    def predict_microbatch(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """``(k,)`` cost of one packed row: the encoder as :class:`PackedCost` predicts it, the LLM
        as one sequence of all the samples' tokens."""
        return self.microbatch_cost_by_position(shapes)(range(len(shapes)))

    def microbatch_cost_by_position(self, shapes: Sequence[SampleShape]) -> Callable[[Sequence[int]], np.ndarray]:
        """:meth:`predict_microbatch` of the rows made of the samples at given positions of
        ``shapes``, their marginal costs and tokens looked up once for all of them (a splitter
        costs thousands of rows of one batch; hashing each sample's shape per row cost more than
        the prediction)."""
        new = [s for s in dict.fromkeys(shapes) if s not in self._marginals]
        if new:
            self._marginals.update(zip(new, self.predict_samples(new)))
        width = len(self.overhead_)
        marginals = np.array([self._marginals[s] for s in shapes], dtype=float).reshape(len(shapes), width)
        tokens = [s.llm_tokens for s in shapes]

        def row_cost(positions: Sequence[int]) -> np.ndarray:
            if not len(positions):
                return np.zeros(width)
            costs = marginals[list(positions)].sum(axis=0) + self.overhead_
            length = sum(tokens[p] for p in positions)
            known = self._rows.get(length)
            costs[-1] = self.row_llm(np.array([length]))[0] if known is None else known
            return costs

        return row_cost

    def predict_microbatches(self, groups: Microbatches) -> np.ndarray:
        """``(n, k)`` :meth:`predict_microbatch` of each microbatch of ``groups`` (zeros for an empty one)."""
        costs = super().predict_microbatches(groups)
        if groups.filled.any():
            tokens = groups.sums(groups.columns.tokens)
            costs[groups.filled, -1] = self.row_llm(tokens[groups.filled])
        return costs
