"""The ``CostModel`` protocol: what every cost model predicts for the scheduler and the planner."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from dflop_ds.shapes import SampleShape


@runtime_checkable
class CostModel(Protocol):
    """Predicted cost of samples and microbatches in columns ``[encoder, llm]``.

    Implemented by :class:`~dflop_ds.cost.FittedCostModel` (profiled, seconds),
    :class:`~dflop_ds.cost.AnalyticMLLM` (FLOP counts, seconds), :class:`~dflop_ds.cost.ProxyCost`
    (unitless LLM-token equivalents, analytic bytes) and :class:`~dflop_ds.cost.PackedCost` (any
    of them for packed microbatches). Every one also has a class attribute ``kind`` (its name in a
    cost-model file, :mod:`dflop_ds.cost.io`) and ``to_dict`` / ``from_dict`` for its state.
    """

    def predict_samples(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """``(n, 2)``: each sample's cost as a microbatch of its own, over the full depth."""
        ...

    def predict_microbatch(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """``(2,)``: the cost of one microbatch of ``shapes`` as the model runs it (padded or packed)."""
        ...

    def predict_memory(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """``(2,)``: bytes one microbatch of ``shapes`` needs beyond the parameters (activations kept
        for backward and the transient peak), per column over the full depth."""
        ...
