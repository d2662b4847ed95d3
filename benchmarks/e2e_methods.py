"""How each method of the end-to-end benchmark splits one global batch into per-rank microbatches.

Every method returns ``ranks[r][j]`` = dataset indices of rank ``r``'s ``j``-th microbatch, with
exactly ``n_mb`` microbatches per rank, so the same engine can run any of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dflop_ds.cost import CostModel, LLMOnlyCost, sampler_cost_model
from dflop_ds.schedule.splitters import MicrobatchCost, RankSplit, SplitRequest, make_splitter
from dflop_ds.shapes import SampleShape
from dflop_ds.sync import SyncModel

#: ``dflop_uniform`` is dflop-ds's scheduling alone, on the baselines' layer-count stage split;
#: ``stock_packed`` is stock's split with packed microbatches (packing's gain without balancing).
#: ``dflop_colocated``: dflop-ds with the encoder beside the pipeline, dispatched over both ranks
#: (:class:`dflop_ds.train.colocated.ColocatedPipeline`); the sampler balances the LLM alone.
METHODS = ("stock", "stock_packed", "llava", "verl", "dflop_uniform", "dflop", "dflop_colocated")
#: the methods that need one engine only, with the local encoder and any one stage split (what
#: ``make bench-hf`` runs): the baselines, stock's split packed, and dflop-ds
ONE_ENGINE_METHODS = ("stock", "stock_packed", "llava", "verl", "dflop")
#: methods whose microbatches are packed, as their users run them: verl removes padding, and
#: dflop-ds packs by default where the model can (``dflop.model.packing``)
PACKED_METHODS = frozenset({"stock_packed", "verl", "dflop_uniform", "dflop", "dflop_colocated"})
#: the registered splitter of each method (the methods differ from it in stage split, packing or
#: where the encoder runs)
SPLITTERS = {
    "stock": "stock",
    "stock_packed": "stock",
    "llava": "llava",
    "verl": "verl",
    "dflop_uniform": "dflop",
    "dflop": "dflop",
    "dflop_colocated": "dflop",
}


def method_cost_model(method: str, cost_model: CostModel | None) -> CostModel:
    """The cost model ``method`` schedules with, wrapped as the training loop wraps it
    (:func:`~dflop_ds.cost.sampler_cost_model`): packed for a method of :data:`PACKED_METHODS`,
    the LLM alone for ``dflop_colocated``, else ``cost_model`` itself (one engine stage's view:
    the benchmarks balance whole-model columns)."""
    if method not in SPLITTERS:
        raise ValueError(f"unknown method {method!r}: choose from {METHODS}")
    return sampler_cost_model(cost_model, colocated=method == "dflop_colocated", packed=method in PACKED_METHODS)


def split_for(
    method: str,
    batch: Sequence[int],
    shapes: Sequence[SampleShape],
    costs: np.ndarray,
    n_mb: int,
    dp: int,
    *,
    microbatch_cost: MicrobatchCost | None = None,
    time_limit_s: float = 0.0,
    seed: int = 0,
    sync: SyncModel | str = SyncModel.PIPELINE,
) -> RankSplit:
    """The split of ``batch`` by ``method`` (one of :data:`METHODS`) with its registered splitter
    (:data:`SPLITTERS`); ``costs`` are the rows of ``batch`` under the dflop cost model,
    ``microbatch_cost`` maps batch positions to a collated microbatch's cost, which only dflop
    reads (for a method of :data:`PACKED_METHODS`, packed costs: additive, so dflop then
    balances ``costs`` alone). ``sync`` is the engine's sync model (:mod:`dflop_ds.sync`)."""
    if method not in SPLITTERS:
        raise ValueError(f"unknown method {method!r}: choose from {METHODS}")
    if method == "dflop_colocated":  # the encoder's work is dispatched separately: balance the LLM alone
        return split_for(
            "dflop",
            batch,
            shapes,
            LLMOnlyCost.drop_encoder(costs),
            n_mb,
            dp,
            time_limit_s=time_limit_s,
            seed=seed,
            sync=sync,
        )
    name = SPLITTERS[method]
    rows = [shapes[i] for i in batch]
    if name != "dflop":
        request = SplitRequest(list(batch), costs, n_mb, dp, shapes=rows, seed=seed, sync=sync)
        return make_splitter(name).split(request).ranks
    packed = method in PACKED_METHODS
    request = SplitRequest(
        list(batch),
        costs,
        n_mb,
        dp,
        shapes=rows,
        seed=seed,
        microbatch_cost=None if packed else microbatch_cost,
        lengths=None if packed else [s.llm_tokens for s in rows],
        sync=sync,
    )
    return make_splitter(name, time_limit_s=time_limit_s).split(request).ranks
