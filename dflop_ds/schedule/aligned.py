"""Microstep-aligned balance: splits for engines whose ranks meet in every microbatch.

Under the ``microstep`` and ``module`` sync models (ZeRO-2 and ZeRO-3, :mod:`dflop_ds.sync`) a
step costs, for each microbatch index ``k``, the slowest rank's ``k``-th microbatch, column by
column under ``module``: ``sum_k sum_c max_r t[r, k, c]``. Rank totals do not matter; what does is
that microstep ``k`` holds work that every rank can share evenly, i.e. alike samples together.
:func:`aligned_split`:

1. orders the samples by a key (:data:`GROUP_KEYS`: the first column, the encoder, then the
   others; or the summed cost) and cuts the order into ``n_mb`` consecutive groups of near-equal
   count, one per microstep (alike samples meet in the same microstep);
2. balances each group's columns across the ``dp`` ranks with equal-count vector differencing;
3. improves each group by moves and swaps out of the slowest rank of each column, scored by the
   group's ``sum_c max_r`` (ties: a lower sum of squared rank loads, which keeps the search
   moving across equal maxima), at most :data:`ROUNDS` accepted changes per group.

Pure and deterministic: stable sorts, ties by index, a fixed round budget, no clock. Each key is
one candidate; the DFLOP splitter scores candidates with :func:`dflop_ds.sync.step_cost`.
"""

from __future__ import annotations

import numpy as np

from dflop_ds.schedule.lpt import differencing_assign
from dflop_ds.shapes import split_evenly

__all__ = ["GROUP_KEYS", "aligned_split", "improve_group", "microstep_groups"]

#: How :func:`microstep_groups` may order samples before cutting them into microsteps.
GROUP_KEYS = ("first", "total")
#: Accepted moves or swaps per microstep group (each round costs ``O(dp)`` numpy work, so the
#: budget is fixed rather than grown with the ranks: the planner calls this at 1024 ranks).
ROUNDS = 48
#: A change must lower a group's score by more than this (relative) to count as a gain.
_EPS = 1e-12


def microstep_groups(costs: np.ndarray, n_mb: int, key: str) -> list[np.ndarray]:
    """The rows of ``costs`` (``(n, c)``) cut into ``n_mb`` microstep groups of near-equal count,
    consecutive in decreasing ``key`` order: ``"first"`` (column 0, then the last, then the sum)
    or ``"total"`` (the sum, then column 0); ties by row."""
    n = costs.shape[0]
    rows, total = np.arange(n), costs.sum(axis=1)
    if key == "first":
        order = np.lexsort((rows, -total, -costs[:, -1], -costs[:, 0]))
    elif key == "total":
        order = np.lexsort((rows, -costs[:, 0], -total))
    else:
        raise ValueError(f"unknown microstep grouping key {key!r}: choose one of {list(GROUP_KEYS)}")
    ends = np.cumsum(split_evenly(n, n_mb))
    return np.split(order, ends[:-1])


def _max_without(loads: np.ndarray, a: int, others: np.ndarray) -> np.ndarray:
    """``(len(others), c)``: per column, the largest load of the ranks other than ``a`` and each
    ``others[i]`` (the top three ranks of each column suffice)."""
    dp, c = loads.shape
    result = np.zeros((others.size, c))
    if dp <= 2:
        return result
    top = np.argsort(-loads, axis=0, kind="stable")[:3]  # (3, c)
    for col in range(c):
        best = np.zeros(others.size)
        for rank in top[::-1, col]:  # the highest written last
            if rank != a:
                best = np.where(others != rank, loads[rank, col], best)
        result[:, col] = best
    return result


def _scored(loads: np.ndarray, a: int, ranks: np.ndarray, new_a: np.ndarray, new_b: np.ndarray):
    """Score and potential of changes that leave rank ``a`` at ``new_a`` and rank ``ranks[j]`` at
    ``new_b[:, j]`` (both ``(m, len(ranks), c)``)."""
    rest = _max_without(loads, a, ranks)[None]
    score = np.maximum(np.maximum(new_a, new_b), rest).sum(axis=2)
    unchanged = float((loads * loads).sum()) - float((loads[a] ** 2).sum()) - (loads[ranks] ** 2).sum(axis=1)[None]
    return score, unchanged + (new_a**2).sum(axis=2) + (new_b**2).sum(axis=2)


def _best_change(costs: np.ndarray, labels: np.ndarray, loads: np.ndarray, a: int):
    """The best move or swap of a row of rank ``a``: ``(score, potential, row, partner)``, where
    ``partner`` is the row swapped with, or ``-1 - rank`` for a move to ``rank``; None when rank
    ``a`` has nothing to give (a move needs two rows: no rank is left empty)."""
    mine = np.flatnonzero(labels == a)
    other = np.flatnonzero(labels != a)
    x = costs[mine][:, None, :]  # (m, 1, c)
    options = []
    if other.size:
        y, b = costs[other][None, :, :], labels[other]
        options.append((*_scored(loads, a, b, loads[a] - x + y, loads[b][None] - y + x), other))
    if mine.size > 1:
        targets = np.array([r for r in range(loads.shape[0]) if r != a], dtype=np.int64)
        new_a = np.broadcast_to(loads[a] - x, (mine.size, targets.size, loads.shape[1]))
        options.append((*_scored(loads, a, targets, new_a, loads[targets][None] + x), -1 - targets))
    best = None
    for score, potential, partners in options:
        flat = int(np.lexsort((np.arange(score.size), potential.ravel(), score.ravel()))[0])
        i, j = divmod(flat, score.shape[1])
        candidate = (float(score.ravel()[flat]), float(potential.ravel()[flat]), int(mine[i]), int(partners[j]))
        if best is None or candidate[:2] < best[:2]:
            best = candidate
    return best


def improve_group(costs: np.ndarray, labels: np.ndarray, dp: int, rounds: int) -> np.ndarray:
    """``labels`` (rank of each row of ``costs``) improved by moves and swaps out of the slowest
    rank of each column while they lower ``sum_c max_r`` of the rank loads (or keep it and lower
    their sum of squares); every rank keeps at least one row. At most ``rounds`` changes."""
    labels = labels.copy()
    loads = np.zeros((dp, costs.shape[1]))
    np.add.at(loads, labels, costs)
    for _ in range(rounds):
        score = float(loads.max(axis=0).sum())
        potential = float((loads * loads).sum())
        best = None
        for a in dict.fromkeys(int(r) for r in np.argmax(loads, axis=0)):
            change = _best_change(costs, labels, loads, a)
            if change is not None and (best is None or change[:2] < best[:2]):
                best = change
        if best is None:
            break
        new_score, new_potential, item, partner = best
        tolerance = _EPS * max(score, 1.0)
        gains = new_score < score - tolerance
        if not (gains or (new_score <= score + tolerance and new_potential < potential * (1 - _EPS))):
            break
        a = int(labels[item])
        if partner >= 0:  # a swap with row ``partner``
            b = int(labels[partner])
            loads[a] += costs[partner] - costs[item]
            loads[b] += costs[item] - costs[partner]
            labels[item], labels[partner] = b, a
        else:
            b = -1 - partner
            loads[a] -= costs[item]
            loads[b] += costs[item]
            labels[item] = b
    return labels


def aligned_split(costs: np.ndarray, dp: int, n_mb: int, key: str, rounds: int = ROUNDS) -> list[list[list[int]]]:
    """``local[r][k]``: the rows of ``costs`` (``(n, c)``, ``n >= dp * n_mb``) in rank ``r``'s
    ``k``-th microbatch, grouped into microsteps by ``key`` (:func:`microstep_groups`) and
    balanced across ranks within each (see the module docstring)."""
    matrix = np.asarray(costs, dtype=float)
    if matrix.ndim == 1:
        matrix = matrix[:, None]
    if matrix.shape[0] < dp * n_mb:
        raise ValueError(f"{matrix.shape[0]} samples cannot fill {n_mb} microbatches on each of {dp} ranks")
    local: list[list[list[int]]] = [[] for _ in range(dp)]
    for group in microstep_groups(matrix, n_mb, key):
        labels = differencing_assign(matrix[group], dp, equal_size=True)
        if dp > 1:
            labels = improve_group(matrix[group], labels, dp, rounds)
        for r in range(dp):
            local[r].append(sorted(group[labels == r].tolist()))
    return local
