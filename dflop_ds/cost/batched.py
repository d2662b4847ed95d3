"""Batched predictions: many microbatches of one batch predicted at once.

The planner times thousands of microbatches for every layout it scores; a Python call of
``predict_microbatch`` each costs far more than the prediction. :class:`Microbatches`
(:mod:`dflop_ds.cost.columns`) holds them flat: the positions of their samples in the batch,
microbatch after microbatch, their sizes, and the batch's per-sample columns
(:class:`SampleColumns`). A cost model whose microbatch cost is a function of sums, maxima and
counts over its samples predicts them all with a few array operations, and declares so
(:class:`~dflop_ds.cost.BatchedCostModel`, :class:`~dflop_ds.cost.BatchedPlannerCostModel`).
:func:`microbatch_costs`, :func:`microbatch_activation_bytes` and :func:`microbatch_working_bytes`
are the one way to ask: they use the declared batched form, and ask any other model microbatch by
microbatch. Row ``j`` of each equals the per-microbatch prediction of microbatch ``j`` (to
rounding where a sum of float per-sample costs is added in another order).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dflop_ds.cost.columns import Microbatches
from dflop_ds.cost.protocol import (
    BatchedCostModel,
    BatchedPlannerCostModel,
    CostModel,
    PlannerCostModel,
    PositionalCostModel,
)
from dflop_ds.shapes import SampleShape


def _each(predict: Callable[[Sequence[SampleShape]], Any], groups: Microbatches) -> np.ndarray:
    """``predict`` of every microbatch of ``groups``, one call each, stacked ``(n, k)``."""
    rows = [np.asarray(predict(shapes), dtype=float).reshape(-1) for shapes in groups.shape_lists()]
    return np.array(rows, dtype=float) if rows else np.zeros((0, 2))


def microbatch_costs(model: CostModel, groups: Microbatches) -> np.ndarray:
    """``(n, k)``: ``model.predict_microbatch`` of each microbatch of ``groups``."""
    if isinstance(model, BatchedCostModel):
        return model.predict_microbatches(groups)
    return _each(model.predict_microbatch, groups)


def microbatch_cost_by_position(
    model: CostModel, shapes: Sequence[SampleShape]
) -> Callable[[Sequence[int]], np.ndarray]:
    """A function of positions in ``shapes`` giving ``model.predict_microbatch`` of those samples:
    the model's own positional form where it has one (:class:`~dflop_ds.cost.PositionalCostModel`),
    else a call with the microbatch's shapes."""
    if isinstance(model, PositionalCostModel):
        return model.microbatch_cost_by_position(shapes)
    predict = model.predict_microbatch
    return lambda positions: predict([shapes[p] for p in positions])


def microbatch_activation_bytes(model: PlannerCostModel, groups: Microbatches) -> np.ndarray:
    """``(n, 2)``: ``model.predict_activation_bytes`` of each microbatch of ``groups`` (a planner model)."""
    if isinstance(model, BatchedPlannerCostModel):
        return model.predict_microbatches_activation_bytes(groups)
    return _each(model.predict_activation_bytes, groups)


def microbatch_working_bytes(model: PlannerCostModel, groups: Microbatches) -> np.ndarray:
    """``(n, 2)``: ``model.predict_working_bytes`` of each microbatch of ``groups`` (a planner model)."""
    if isinstance(model, BatchedPlannerCostModel):
        return model.predict_microbatches_working_bytes(groups)
    return _each(model.predict_working_bytes, groups)
