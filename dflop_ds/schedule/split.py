"""Split one global batch into per-rank microbatches: the stock way and the balanced way.

Both are pure functions of their inputs, so every rank computes the same split independently.
A split is ``list[rank] -> list[microbatch] -> list[sample index]`` with exactly ``n_mb``
non-empty microbatches per rank and every sample of the batch exactly once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

from dflop_ds.schedule.partition import partition_batch
from dflop_ds.schedule.ranks import assign_to_ranks, lockstep_order

RankSplit = list[list[list[int]]]
MicrobatchCost = Callable[[Sequence[int]], np.ndarray]

logger = logging.getLogger(__name__)
#: Suffix of ``SplitResult.solver`` when the exact solver failed and the heuristic answered.
FALLBACK_SUFFIX = "+fallback"
_warned_fallback: set[str] = set()


@dataclass(frozen=True)
class SplitResult:
    """A split with how it was found.

    Attributes:
        ranks: ``ranks[r][j]`` is the sample indices of rank ``r``'s ``j``-th microbatch.
        predicted: ``(dp, n_mb, k)`` predicted cost of each microbatch.
        makespan: the largest predicted microbatch cost over all columns.
        lower_bound: a lower bound on any split's makespan (0 when not computed).
        solver: the method that produced the split.
    """

    ranks: RankSplit
    predicted: np.ndarray
    makespan: float
    lower_bound: float
    solver: str


def _predict(ranks: RankSplit, costs: np.ndarray, microbatch_cost: Optional[MicrobatchCost]) -> np.ndarray:
    def one(mb: list[int]) -> np.ndarray:
        if microbatch_cost is not None:
            return np.asarray(microbatch_cost(mb), dtype=float)
        return costs[mb].sum(axis=0)

    return np.array([[one(mb) for mb in rank] for rank in ranks], dtype=float)


def _check_sizes(n_items: int, n_mb: int, dp: int) -> None:
    if n_mb < 1 or dp < 1:
        raise ValueError(f"need n_mb >= 1 and dp >= 1, got n_mb={n_mb}, dp={dp}")
    if n_items < n_mb * dp:
        raise ValueError(f"a batch of {n_items} samples cannot fill {n_mb} microbatches on each of {dp} ranks")


def split_stock(
    batch: Sequence[int],
    costs: np.ndarray,
    n_mb: int,
    dp: int,
    microbatch_cost: Optional[MicrobatchCost] = None,
) -> SplitResult:
    """What stock DeepSpeed does: each rank takes a contiguous slice of the (shuffled) batch and
    cuts it into ``n_mb`` consecutive microbatches of equal sample count (sizes differ by at most
    one when the count does not divide)."""
    _check_sizes(len(batch), n_mb, dp)
    positions = np.arange(len(batch))
    local = [[chunk.tolist() for chunk in np.array_split(part, n_mb)] for part in np.array_split(positions, dp)]
    predicted = _predict(local, np.asarray(costs, dtype=float).reshape(len(batch), -1), microbatch_cost)
    return _result(local, batch, predicted, 0.0, "stock")


def _result(local: RankSplit, batch: Sequence[int], predicted: np.ndarray, lower_bound: float,
            solver: str) -> SplitResult:
    """Turn a split over batch positions, with its ``(dp, n_mb, k)`` predicted costs, into a
    :class:`SplitResult` over sample indices."""
    items = np.asarray(batch)
    ranks = [[[int(items[p]) for p in mb] for mb in rank] for rank in local]
    return SplitResult(ranks, predicted, float(predicted.max()), lower_bound, solver)


def split_balanced(
    batch: Sequence[int],
    costs: np.ndarray,
    n_mb: int,
    dp: int,
    microbatch_cost: Optional[MicrobatchCost] = None,
    time_limit_s: float = 0.0,
    seed: int = 0,
    lengths: Optional[Sequence[float]] = None,
    node_limit: int = 0,
    lockstep: bool = False,
) -> SplitResult:
    """DFLOP's split: partition the batch into ``n_mb * dp`` microbatches minimising the slowest
    one on every cost column (encoder and LLM), assign them to ranks evenly, order each rank's
    microbatches to shorten pipeline fill and drain.

    ``lockstep`` is for engines without a pipeline whose data-parallel ranks synchronise in every
    microbatch (ZeRO): a microbatch then costs the sum of its columns (encoder and LLM run one
    after the other), and microbatch ``k`` of every rank gets a similar cost
    (:func:`~dflop_ds.schedule.ranks.lockstep_order`); ``predicted`` has one column.

    ``costs`` is ``(len(batch), k)``, row ``i`` the predicted cost of ``batch[i]``;
    ``microbatch_cost`` maps positions within the batch to a microbatch's true (e.g. padded)
    cost; ``lengths`` (per batch row, e.g. LLM tokens) enable the padding-aware starts when
    that cost pads to the longest sample. ``time_limit_s`` and ``node_limit`` bound the exact
    solver (both 0: heuristic only). Ranks computing the split independently need a
    deterministic answer: no time limit (the heuristic, or the ILP within ``node_limit`` nodes).
    """
    _check_sizes(len(batch), n_mb, dp)
    cost_matrix = np.asarray(costs, dtype=float).reshape(len(batch), -1)
    if lockstep:
        cost_matrix = cost_matrix.sum(axis=1, keepdims=True)
        if microbatch_cost is not None:
            columns = microbatch_cost
            microbatch_cost = lambda positions: np.atleast_1d(np.asarray(columns(positions), dtype=float).sum())  # noqa: E731
    partition, solver = _partition_or_fallback(
        partition_batch, cost_matrix, n_mb * dp, time_limit_s, node_limit,
        seed=seed, microbatch_cost=microbatch_cost, lengths=None if lengths is None else np.asarray(lengths, float),
    )
    assign = lockstep_order if lockstep else assign_to_ranks
    order = assign(partition.bucket_costs, dp, n_mb)  # costs as the partitioner measured them
    local = [[list(partition.buckets[b]) for b in rank] for rank in order]
    predicted = partition.bucket_costs[np.asarray(order)]
    return _result(local, batch, predicted, float(partition.lower_bound), solver)


def _partition_or_fallback(partition_batch, cost_matrix: np.ndarray, n_buckets: int, time_limit_s: float,
                           node_limit: int = 0, **options):
    """``partition_batch``, falling back to its heuristic alone when the exact solver fails.

    Bad input (a ``ValueError``, e.g. a negative or NaN cost) is raised as is. Any other error
    with the solver enabled (a PuLP error, a missing CBC binary, an OS error starting it) is
    logged once per error type and answered by the deterministic heuristic; ``solver`` then
    ends in :data:`FALLBACK_SUFFIX`. ``options`` go to ``partition_batch`` as they are.
    Returns ``(partition, solver)``.
    """
    try:
        partition = partition_batch(cost_matrix, n_buckets, time_limit_s=time_limit_s, node_limit=node_limit,
                                    **options)
        return partition, partition.solver
    except ValueError:
        raise
    except Exception as error:  # noqa: BLE001 - any solver failure must not stop training
        if time_limit_s <= 0 and node_limit <= 0:
            raise
        kind = type(error).__name__
        if kind not in _warned_fallback:
            _warned_fallback.add(kind)
            logger.warning("exact partition solver failed (%s: %s); using the heuristic split instead "
                           "(logged once per error type)", kind, error)
    partition = partition_batch(cost_matrix, n_buckets, time_limit_s=0.0, **options)
    return partition, partition.solver + FALLBACK_SUFFIX
