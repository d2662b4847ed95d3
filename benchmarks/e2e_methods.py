"""How each method of the end-to-end benchmark splits one global batch into per-rank microbatches.

Every method returns ``ranks[r][j]`` = dataset indices of rank ``r``'s ``j``-th microbatch, with
exactly ``n_mb`` microbatches per rank, so the same engine can run any of them.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np

from benchmarks.baselines import llava_modality_grouped, verl_karmarkar_karp, verl_workload
from dflop_ds.schedule.split import RankSplit, split_balanced, split_stock
from dflop_ds.shapes import SampleShape
from dflop_ds.train.colocated import LLMOnlyCost

#: ``dflop_uniform`` is dflop-ds's scheduling alone, on the baselines' layer-count stage split;
#: ``stock_packed`` is stock's split with packed microbatches (packing's gain without balancing).
#: ``dflop_colocated``: dflop-ds with the encoder beside the pipeline, dispatched over both ranks
#: (:class:`dflop_ds.train.colocated.ColocatedPipeline`); the sampler balances the LLM alone.
METHODS = ("stock", "stock_packed", "llava", "verl", "dflop_uniform", "dflop", "dflop_colocated")
#: methods whose microbatches are packed, as their users run them: verl removes padding, and
#: dflop-ds packs by default where the model can (``"dflop".packing``)
PACKED_METHODS = frozenset({"stock_packed", "verl", "dflop_uniform", "dflop", "dflop_colocated"})


def _deal(buckets: list[list[int]], batch: Sequence[int], n_mb: int, dp: int) -> RankSplit:
    """Buckets over batch positions -> per-rank microbatches of dataset indices, bucket ``b`` on
    rank ``b // n_mb`` (consecutive buckets per rank, as a sequential loader deals them)."""
    return [[[int(batch[p]) for p in buckets[r * n_mb + j]] for j in range(n_mb)] for r in range(dp)]


def both_ends_order(workloads: Sequence[float]) -> list[int]:
    """verl's pipeline order: the smallest microbatches at both ends, the largest in the middle."""
    ascending = np.argsort(np.asarray(workloads, dtype=float), kind="stable").tolist()
    return ascending[0::2] + ascending[1::2][::-1]


def split_llava(batch: Sequence[int], shapes: Sequence[SampleShape], n_mb: int, dp: int, seed: int) -> RankSplit:
    """LLaVA's modality-grouped length sampler, lengths as LLaVA measures them (text tokens)."""
    group = [shapes[i] for i in batch]
    lengths = np.array([s.text_tokens for s in group], dtype=float)
    multimodal = np.array([s.encoder_tiles > 0 for s in group])
    buckets = llava_modality_grouped(lengths, multimodal, n_mb * dp, world_size=dp, seed=seed)
    return _deal(buckets, batch, n_mb, dp)


def split_verl(batch: Sequence[int], shapes: Sequence[SampleShape], n_mb: int, dp: int) -> RankSplit:
    """verl: Karmarkar-Karp over ranks on LLM sequence length, then per rank into microbatches,
    ordered with the small ones at both ends of the pipeline."""
    seqlens = np.array([shapes[i].llm_tokens for i in batch], dtype=float)
    ranks: RankSplit = []
    for rank_positions in verl_karmarkar_karp(seqlens, dp):
        local = np.asarray(rank_positions)
        micro = verl_karmarkar_karp(seqlens[local], n_mb)
        work = [verl_workload(seqlens[local[m]]).sum() for m in micro]
        ranks.append([[int(batch[local[p]]) for p in micro[j]] for j in both_ends_order(work)])
    return ranks


def split_for(
    method: str,
    batch: Sequence[int],
    shapes: Sequence[SampleShape],
    costs: np.ndarray,
    n_mb: int,
    dp: int,
    *,
    microbatch_cost: Optional[Callable[[Sequence[int]], np.ndarray]] = None,
    time_limit_s: float = 0.0,
    seed: int = 0,
) -> RankSplit:
    """The split of ``batch`` by ``method`` (one of :data:`METHODS`); ``costs`` are the rows of
    ``batch`` under the dflop cost model, ``microbatch_cost`` maps batch positions to a collated
    microbatch's cost (for a method of :data:`PACKED_METHODS`, packed costs: additive, so dflop
    then balances ``costs`` alone)."""
    if method in ("stock", "stock_packed"):
        return split_stock(list(batch), costs, n_mb, dp).ranks
    if method == "llava":
        return split_llava(batch, shapes, n_mb, dp, seed)
    if method == "verl":
        return split_verl(batch, shapes, n_mb, dp)
    if method == "dflop_colocated":  # the encoder's work is dispatched separately: balance the LLM alone
        return split_for("dflop", batch, shapes, LLMOnlyCost.drop_encoder(costs), n_mb, dp, time_limit_s=time_limit_s,
                         seed=seed)
    if method in ("dflop", "dflop_uniform"):
        packed = method in PACKED_METHODS
        lengths = None if packed else [shapes[i].llm_tokens for i in batch]
        return split_balanced(list(batch), costs, n_mb, dp, None if packed else microbatch_cost,
                              time_limit_s=time_limit_s, seed=seed, lengths=lengths).ranks
    raise ValueError(f"unknown method {method!r}: choose from {METHODS}")
