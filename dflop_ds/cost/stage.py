"""A cost model's predictions per pipeline stage instead of per model segment.

A cost model predicts ``[encoder, llm]`` per sample; a pipeline stage holds some share of each
(:func:`dflop_ds.plan.stages.stage_shares`). :class:`StageCost` turns the two columns into one
column per stage, so the partitioner balances what each stage computes and telemetry compares
stage ``s``'s observed compute with column ``s``.

Memory is split the same way: stage ``s`` keeps its share of a microbatch's activation bytes,
for each of the microbatches it holds in flight under 1F1B (:func:`in_flight_microbatches`), so
a device's activation budget allows stage ``s`` microbatches of ``budget / in_flight[s]`` bytes
of its share (:func:`stage_memory_caps`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dflop_ds.cost.batched import microbatch_costs
from dflop_ds.cost.columns import Microbatches
from dflop_ds.cost.protocol import CostModel
from dflop_ds.shapes import SampleShape


def in_flight_microbatches(num_stages: int, microbatches: int | None = None) -> np.ndarray:
    """``(num_stages,)``: how many microbatches' activations stage ``s`` keeps at once under 1F1B.

    Stage ``s`` of ``p`` runs ``p - s`` forwards before its first backward, so it holds up to
    ``p - s`` microbatches, never more than the step's ``microbatches`` (DeepSpeed's
    ``TrainSchedule.num_pipe_buffers``). ``microbatches`` None: ``p - s``.
    """
    if num_stages < 1 or (microbatches is not None and microbatches < 1):
        raise ValueError(f"need num_stages >= 1 and microbatches >= 1, got {num_stages}, {microbatches}")
    held = num_stages - np.arange(num_stages)
    return held if microbatches is None else np.minimum(held, microbatches)


def stage_memory_caps(budget: float, num_stages: int, microbatches: int | None = None) -> np.ndarray:
    """``(num_stages,)``: the bytes of its own share one microbatch may need on stage ``s``, when
    a device may hold ``budget`` bytes of activations: ``budget / in_flight[s]``
    (:func:`in_flight_microbatches`)."""
    return float(budget) / in_flight_microbatches(num_stages, microbatches)


class StageCost:
    """``cost_model``'s predictions as ``(num_stages,)`` columns: ``shares[s] @ [encoder, llm]``.

    ``shares`` is ``(num_stages, k)``, the share of each of the model's ``k`` columns every stage
    holds. The mapping is linear, so an additive model (``PackedCost``) stays additive.
    ``microbatches`` (the step's gradient accumulation steps; None: as many as stages) sets how
    many microbatches each stage holds in flight, for :meth:`predict_memory`.
    """

    #: telemetry pairs stage ``s`` with predicted column ``s``
    per_stage = True
    #: :meth:`predict_memory`'s columns are the bytes of different devices: a memory cap bounds
    #: each of them, not their sum (:func:`dflop_ds.schedule.memory.microbatch_bytes`)
    memory_per_device = True

    def __init__(self, cost_model: CostModel, shares: np.ndarray, microbatches: int | None = None) -> None:
        self.cost_model = cost_model
        self.shares = np.asarray(shares, dtype=float)
        if self.shares.ndim != 2:
            raise ValueError(f"stage shares must be (num_stages, columns), got shape {self.shares.shape}")
        # a linear map of the wrapped model's columns: its additivity and memory carry over
        self.additive = cost_model.additive
        self.predicts_memory = cost_model.predicts_memory
        self.is_analytic = cost_model.is_analytic
        self.in_flight = in_flight_microbatches(len(self.shares), microbatches)

    def predict_samples(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """``(n, num_stages)`` predicted cost of each sample on each stage."""
        costs = np.asarray(self.cost_model.predict_samples(shapes), dtype=float).reshape(len(shapes), -1)
        return costs @ self.shares.T

    def predict_microbatch(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """``(num_stages,)`` predicted cost of one microbatch on each stage."""
        return self.shares @ np.asarray(self.cost_model.predict_microbatch(shapes), dtype=float).reshape(-1)

    def predict_microbatches(self, groups: Microbatches) -> np.ndarray:
        """``(n, num_stages)`` predicted cost of each microbatch of ``groups`` on each stage."""
        return np.asarray(microbatch_costs(self.cost_model, groups), dtype=float) @ self.shares.T

    def predict_memory(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """``(num_stages,)`` activation bytes stage ``s``'s device holds if all its microbatches in
        flight were like this one: its share of the wrapped model's memory columns times
        ``in_flight[s]``. A device budget ``B`` bounds each entry; entry ``s`` <= ``B`` is the same
        as the stage's share <= ``stage_memory_caps(B, ...)[s]``."""
        columns = np.asarray(self.cost_model.predict_memory(shapes), dtype=float).reshape(-1)
        return self.in_flight * (self.shares @ columns)
