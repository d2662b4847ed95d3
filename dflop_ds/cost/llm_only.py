"""The LLM side of a cost model: what the sampler balances when a colocated encoder's work is
dispatched over the ranks separately (:mod:`dflop_ds.train.colocated`), so that the encoder costs
the mean over ranks whatever the split."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from dflop_ds.cost.batched import microbatch_costs
from dflop_ds.cost.columns import Microbatches
from dflop_ds.cost.protocol import CostModel
from dflop_ds.shapes import SampleShape


class LLMOnlyCost:
    """A cost model's predictions with the encoder column zeroed: what the sampler balances when
    the encoder's work is dispatched separately (the encoder costs the mean over ranks anyway)."""

    #: a colocated encoder's activations live on the ranks its work is dispatched to, not with the
    #: LLM work balanced here: no byte count of this model is what one device holds
    predicts_memory = False

    def __init__(self, cost_model: CostModel) -> None:
        self.cost_model = cost_model
        # the wrapped model's columns and their additivity (a zeroed column adds nothing)
        self.additive = cost_model.additive
        self.per_stage = cost_model.per_stage
        self.memory_per_device = cost_model.memory_per_device
        self.is_analytic = cost_model.is_analytic

    @staticmethod
    def drop_encoder(costs: Any) -> np.ndarray:
        """A copy of ``costs`` (rows ``[encoder, llm]``) with the encoder column zeroed."""
        costs = np.array(costs, dtype=float)
        costs[..., 0] = 0.0
        return costs

    def predict_samples(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """Per-sample ``[0, llm]``."""
        return self.drop_encoder(self.cost_model.predict_samples(shapes))

    def predict_microbatch(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """A collated (padded) microbatch's ``[0, llm]``."""
        return self.drop_encoder(self.cost_model.predict_microbatch(shapes))

    def predict_microbatches(self, groups: Microbatches) -> np.ndarray:
        """Each microbatch's ``[0, llm]`` (:meth:`predict_microbatch` of each of ``groups``)."""
        return self.drop_encoder(microbatch_costs(self.cost_model, groups))

    def predict_memory(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """Refused: this model predicts no memory (``predicts_memory`` is False)."""
        raise ValueError(f"{type(self).__name__} predicts no memory: the encoder's work is dispatched apart")
