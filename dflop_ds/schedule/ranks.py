"""Map balanced microbatches (buckets) to data-parallel ranks and order them for the pipeline.

DeepSpeed runs ``gradient_accumulation_steps`` microbatches on every dp rank, so each rank must
get exactly ``n_mb`` buckets; the slowest rank gates the step, so the ranks' totals must be
balanced; and within a rank the order decides how long the pipeline fills and drains.
"""

from __future__ import annotations

import numpy as np

from dflop_ds.schedule.group_sums import group_sums
from dflop_ds.schedule.lower_bounds import as_cost_matrix
from dflop_ds.schedule.lpt import differencing_assign, improve

__all__ = ["assign_to_ranks", "lockstep_order", "pipeline_order", "rank_totals"]

#: Ranks :func:`assign_to_ranks` looks among for a swap partner of the slowest rank: every rank up
#: to this many, beyond it the 16 lightest first, then this many lightest. A search over every rank
#: grows as ``dp`` squared (a round scans every bucket, and the ranks take about ``dp`` rounds to
#: level): 17 s of CPU at 2048 ranks of 16 microbatches against 0.2 s for the lightest 256, with
#: the same slowest rank (measured on the planner's 16384-GPU batches).
RANK_SWAP_PARTNERS = 256


def rank_totals(bucket_costs: np.ndarray, ranks: list[list[int]] | np.ndarray) -> np.ndarray:
    """``(dp, k)`` summed bucket costs of each rank, each rounded as numpy's sum of that rank's
    rows alone (:func:`~dflop_ds.schedule.group_sums.group_sums`): :func:`assign_to_ranks`
    compares these totals, and a sum in another order (e.g. ``np.add.at``'s, with one cost
    column) rounds differently and could resolve a near tie between two splits otherwise than
    before."""
    return group_sums(as_cost_matrix(bucket_costs), ranks)


def pipeline_order(bucket_costs: np.ndarray, buckets: list[int]) -> list[int]:
    """Order one rank's buckets to shorten the pipeline's fill and drain.

    In a 1F1B pipeline the first microbatch's forward pass must cross every stage before the
    last stage has work (fill), and the last microbatch's backward pass must cross every stage
    back while the others idle (drain); microbatches in between overlap with each other. The
    bubble therefore grows with the first microbatch's cost on the first stages and the last
    microbatch's cost on the last stages. Column 0 (the encoder) runs on the first stages and
    the last column (the LLM) on the last, so: the bucket with the smallest first-column cost
    goes first, the one with the smallest last-column cost (of the rest) goes last, and the
    others rise then fall in total cost, larger ones in the middle, where they overlap with
    their neighbours (verl places small microbatches at both ends for the same reason).
    """
    return _ordered(as_cost_matrix(bucket_costs), np.asarray([buckets], dtype=np.int64).reshape(1, -1))[0].tolist()


def _ordered(matrix: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """:func:`pipeline_order` of every row of ``ranks`` (``(dp, n)`` bucket numbers into ``matrix``'s
    rows) at once: ties between equal costs go to the lower bucket number, as in a sort by
    ``(cost, number)`` (per-rank sorts made :func:`assign_to_ranks` slower than its balancing at
    thousands of ranks)."""
    total, first_column, last_column = (key[ranks] for key in (matrix.sum(axis=1), matrix[:, 0], matrix[:, -1]))
    by_total = np.take_along_axis(ranks, np.lexsort((ranks, total), axis=-1), axis=-1)
    if ranks.shape[1] <= 1:
        return by_total
    first = np.take_along_axis(ranks, np.lexsort((ranks, total, first_column), axis=-1)[:, :2], axis=-1)[:, 0]
    lasts = np.take_along_axis(ranks, np.lexsort((ranks, total, last_column), axis=-1)[:, :2], axis=-1)
    last = np.where(lasts[:, 0] == first, lasts[:, 1], lasts[:, 0])  # the lowest of the rest
    rest = by_total[(by_total != first[:, None]) & (by_total != last[:, None])].reshape(len(ranks), -1)
    return np.column_stack([first, rest[:, 0::2], rest[:, 1::2][:, ::-1], last])


def assign_to_ranks(bucket_costs: np.ndarray, dp: int, n_mb: int) -> list[list[int]]:
    """Assign ``dp * n_mb`` buckets to ``dp`` ranks, exactly ``n_mb`` each, in execution order.

    ``bucket_costs`` is ``(m, k)`` (columns ``[encoder, llm]``; 1-D means one column). A rank's
    time is taken as the largest of its column sums (each column is a group of pipeline stages
    working through all of the rank's microbatches); the slowest rank gates the step. Ranks are
    balanced by equal-count vector differencing (Karmarkar-Karp), then swaps between the slowest
    rank and the others (the lightest :data:`RANK_SWAP_PARTNERS` of them), and never end worse
    than dealing the buckets round robin from the largest (the heuristic has no such guarantee of
    its own); each rank's buckets are then ordered by :func:`pipeline_order`.
    """
    matrix = as_cost_matrix(bucket_costs)
    if dp < 1 or n_mb < 1:
        raise ValueError(f"dp and n_mb must be >= 1, got dp={dp}, n_mb={n_mb}")
    if matrix.shape[0] != dp * n_mb:
        raise ValueError(f"expected dp * n_mb = {dp * n_mb} buckets, got {matrix.shape[0]}")
    labels = differencing_assign(matrix, dp, equal_size=True)
    if dp > 1:
        partners = (dp,) if dp <= RANK_SWAP_PARTNERS else (16, RANK_SWAP_PARTNERS)
        labels = improve(matrix, labels, dp, allow_moves=False, resplit=0, partners=partners)
    counts = np.bincount(labels, minlength=dp)
    if (counts != n_mb).any():  # guaranteed by equal-size differencing and swaps; checked anyway
        raise AssertionError(f"rank sizes {counts.tolist()} differ from n_mb={n_mb}")
    ranks = np.argsort(labels, kind="stable").reshape(dp, n_mb)  # each rank's buckets, ascending
    by_size = np.argsort(-matrix.max(axis=1), kind="stable")
    dealt = np.sort(by_size.reshape(n_mb, dp).T, axis=1)  # rank r: by_size[r::dp], ascending
    if rank_totals(matrix, dealt).max() < rank_totals(matrix, ranks).max():
        ranks = dealt
    return _ordered(matrix, ranks).tolist()


def lockstep_order(bucket_costs: np.ndarray, dp: int, n_mb: int) -> list[list[int]]:
    """Assign ``dp * n_mb`` buckets to ``dp`` ranks for engines whose ranks meet every microbatch.

    Without a pipeline, ZeRO data parallel reduces gradients in every microbatch's backward, so
    microbatch ``k`` of all ranks ends together and a step costs the sum over ``k`` of the
    slowest rank's ``k``-th microbatch. Sorting the buckets by cost (the sum of the columns:
    encoder and LLM run one after the other on the same device) and giving microbatch ``k`` of
    every rank the ``k``-th group of ``dp`` consecutive buckets minimises that sum for the given
    buckets. Within a group, buckets go to ranks so that rank totals stay even (the largest to
    the rank with the smallest total so far). Returns bucket indices per rank in execution order.
    """
    matrix = as_cost_matrix(bucket_costs)
    if dp < 1 or n_mb < 1:
        raise ValueError(f"dp and n_mb must be >= 1, got dp={dp}, n_mb={n_mb}")
    if matrix.shape[0] != dp * n_mb:
        raise ValueError(f"expected dp * n_mb = {dp * n_mb} buckets, got {matrix.shape[0]}")
    total = matrix.sum(axis=1)
    order = sorted(range(len(total)), key=lambda j: (-total[j], j))
    ranks: list[list[int]] = [[] for _ in range(dp)]
    sums = np.zeros(dp)
    for k in range(n_mb):
        group = order[k * dp : (k + 1) * dp]
        free = sorted(range(dp), key=lambda r: (sums[r], r))
        for bucket, rank in zip(group, free):
            ranks[rank].append(bucket)
            sums[rank] += total[bucket]
    return ranks
