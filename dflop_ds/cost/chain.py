"""The wrapper chain: which wrappers a cost model gets before a sampler balances with it, and in what order: the one
place that decides it (the training loop and the benchmarks call :func:`sampler_cost_model`), and which model of a chain
predicts no memory (:func:`memory_blind_model`), and whether a chain packs (:func:`packs_microbatches`).

The chain, innermost first:

1. the profiled model, or :class:`~dflop_ds.cost.ProxyCost` when nothing was profiled;
2. :class:`~dflop_ds.cost.LLMOnlyCost` under a colocated encoder (its work is dispatched apart);
3. :class:`~dflop_ds.cost.PackedCost` when microbatches are packed (a sample costs its marginal),
   :class:`~dflop_ds.cost.RowPackedCost` when a packed row's attention spans the whole row;
4. :class:`~dflop_ds.cost.StageCost` on a pipeline with a profiled model, no runtime correction
   (which replaces the columns with its own per-stage seconds) and the encoder in the pipeline.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from dflop_ds.cost.llm_only import LLMOnlyCost
from dflop_ds.cost.packed import PackedCost, RowPackedCost
from dflop_ds.cost.protocol import CostModel, CostWrapper
from dflop_ds.cost.proxy import ProxyCost
from dflop_ds.cost.stage import StageCost


def sampler_cost_model(
    profiled: CostModel | None,
    *,
    colocated: bool = False,
    packed: bool = False,
    row_attention: bool = False,
    stage_shares: Callable[[], np.ndarray] | None = None,
    corrected: bool = False,
    microbatches: int = 1,
) -> CostModel:
    """The cost model a sampler balances with, built on ``profiled`` (None: the unitless
    :class:`~dflop_ds.cost.ProxyCost`).

    ``colocated``: the encoder runs beside the pipeline, dispatched by cost; ``packed``: the
    microbatches are packed; ``row_attention``: a packed row's attention spans the whole row (not
    each sample apart); ``stage_shares``: None without a pipeline, else a function giving
    ``(num_stages, 2)``, each stage's share of the encoder and LLM cost
    (:func:`dflop_ds.plan.stages.stage_shares`), called only when the chain predicts per stage;
    ``corrected``: a runtime correction adjusts the costs; ``microbatches``: how many a pipeline
    stage holds in flight (the gradient accumulation steps)."""
    model = ProxyCost() if profiled is None else profiled
    if colocated:
        model = LLMOnlyCost(model)
    if packed:
        model = RowPackedCost(model) if row_attention else PackedCost(model)
    # per stage: a profiled model (the proxy has no layer shares) on a pipeline holding the encoder
    if stage_shares is not None and profiled is not None and not colocated and not corrected:
        model = StageCost(model, stage_shares(), microbatches=microbatches)
    return model


def _chain(cost_model: CostModel) -> Iterator[CostModel]:
    """``cost_model`` and the models it wraps (``.cost_model``), outermost first."""
    model: CostModel | None = cost_model
    while model is not None:
        yield model
        model = model.cost_model if isinstance(model, CostWrapper) else None


def memory_blind_model(cost_model: CostModel) -> CostModel | None:
    """The model of ``cost_model``'s chain (itself and the models it wraps, ``.cost_model``) that
    makes it predict no memory: the innermost one without ``predicts_memory`` whose inner model has
    it (e.g. the :class:`~dflop_ds.cost.LLMOnlyCost` in a :class:`~dflop_ds.cost.PackedCost`);
    None when the chain predicts memory."""
    blind = None
    for model in _chain(cost_model):
        if model.predicts_memory:
            break
        blind = model
    return blind


def packs_microbatches(cost_model: CostModel) -> bool:
    """Whether ``cost_model``'s chain (itself and the models it wraps) packs microbatches (a
    :class:`~dflop_ds.cost.PackedCost` in it): no padding, whatever its cost's additivity."""
    return any(isinstance(model, PackedCost) for model in _chain(cost_model))
