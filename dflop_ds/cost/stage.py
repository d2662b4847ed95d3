"""A cost model's predictions per pipeline stage instead of per model segment.

A cost model predicts ``[encoder, llm]`` per sample; a pipeline stage holds some share of each
(:func:`dflop_ds.plan.stages.stage_shares`). :class:`StageCost` turns the two columns into one
column per stage, so the partitioner balances what each stage computes and telemetry compares
stage ``s``'s observed compute with column ``s``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from dflop_ds.shapes import SampleShape


class StageCost:
    """``cost_model``'s predictions as ``(num_stages,)`` columns: ``shares[s] @ [encoder, llm]``.

    ``shares`` is ``(num_stages, k)``, the share of each of the model's ``k`` columns every stage
    holds. The mapping is linear, so an additive model (``PackedCost``) stays additive.
    """

    #: telemetry pairs stage ``s`` with predicted column ``s``
    per_stage = True

    def __init__(self, cost_model: Any, shares: np.ndarray) -> None:
        self.cost_model = cost_model
        self.shares = np.asarray(shares, dtype=float)
        if self.shares.ndim != 2:
            raise ValueError(f"stage shares must be (num_stages, columns), got shape {self.shares.shape}")
        self.additive = bool(getattr(cost_model, "additive", False))

    def predict_samples(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """``(n, num_stages)`` predicted cost of each sample on each stage."""
        costs = np.asarray(self.cost_model.predict_samples(shapes), dtype=float).reshape(len(shapes), -1)
        return costs @ self.shares.T

    def predict_microbatch(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """``(num_stages,)`` predicted cost of one microbatch on each stage."""
        return self.shares @ np.asarray(self.cost_model.predict_microbatch(shapes), dtype=float).reshape(-1)

    def predict_memory(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """The wrapped model's ``[encoder, llm]`` memory bytes (memory is not split by stage here)."""
        return np.asarray(self.cost_model.predict_memory(shapes), dtype=float)
