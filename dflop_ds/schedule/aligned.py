"""Microstep-aligned balance: splits for engines whose ranks meet in every microbatch.

Under the ``microstep`` and ``module`` sync models (ZeRO-2 and ZeRO-3, :mod:`dflop_ds.sync`) a
step costs, for each microbatch index ``k``, the slowest rank's ``k``-th microbatch, column by
column under ``module``: ``sum_k sum_c max_r t[r, k, c]``. Rank totals do not matter; what does is
that microstep ``k`` holds work that every rank can share evenly, i.e. alike samples together.
:func:`aligned_split`:

1. orders the samples by a key (:data:`GROUP_KEYS`: the first column, the encoder, then the
   others; or the summed cost) and cuts the order into ``n_mb`` consecutive groups of near-equal
   count, one per microstep (alike samples meet in the same microstep);
2. balances each group's columns across the ``dp`` ranks with equal-count vector differencing,
   and keeps the key whose groups score lowest;
3. improves the whole grid by moves and swaps of samples, within a microstep or across two, out
   of the slowest rank of each microstep and column, scored by ``sum_k sum_c max_r`` (ties: a
   lower sum of squared cell loads, which keeps the search moving across equal maxima), at most
   :data:`ROUNDS` changes, stopping after :data:`PATIENCE` rounds without a lower score.

Pure and deterministic: stable sorts, ties by index, a fixed round budget, no clock. The DFLOP
splitter scores the result against its other candidates with :func:`dflop_ds.sync.step_cost`.
"""

from __future__ import annotations

import numpy as np

from dflop_ds.schedule.lpt import differencing_assign
from dflop_ds.shapes import split_evenly

__all__ = ["GROUP_KEYS", "aligned_split", "improve_grid", "microstep_groups"]

#: How :func:`microstep_groups` may order samples before cutting them into microsteps.
GROUP_KEYS = ("first", "total")
#: Moves or swaps of :func:`improve_grid` (each round costs ``O(n)`` numpy work, so the budget
#: is fixed rather than grown with the ranks: the planner calls this at 1024 ranks) ...
ROUNDS = 96
#: ... and at most this many samples times rounds (fewer rounds for large batches).
ROUND_WORK = 65_536
#: Rounds without a lower score after which the search stops.
PATIENCE = 24
#: A change must lower the score by more than this (relative) to count as a gain.
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


def _max_without(top_values: np.ndarray, top_ranks: np.ndarray, steps: np.ndarray, *excluded: np.ndarray) -> np.ndarray:
    """``(N, c)``: per column, the largest rank load of microstep ``steps[j]`` among its ranks
    other than ``excluded[..][j]`` (-1: none), from each microstep's top three ranks per column
    (``top_values``, ``top_ranks``: ``(n_mb, <=3, c)``, highest first; two exclusions at most)."""
    values, ranks = top_values[steps], top_ranks[steps]  # (N, t, c)
    result = np.zeros((steps.size, values.shape[2]))
    for t in range(values.shape[1] - 1, -1, -1):  # the highest written last
        ok = np.ones(ranks[:, t, :].shape, dtype=bool)
        for rank in excluded:
            ok &= ranks[:, t, :] != rank[:, None]
        result = np.where(ok, values[:, t, :], result)
    return result


def _best_change(costs: np.ndarray, cells: np.ndarray, loads: np.ndarray, tops: tuple, source: int, dp: int):
    """The best move or swap of a row out of cell ``source`` (``cell = microstep * dp + rank``):
    ``(gain, potential change, row, partner)``, ``partner`` the row swapped with or ``-1 - cell``
    for a move to ``cell``; a move needs two rows in ``source`` (no microbatch is left empty).
    ``tops``: each microstep's top three ranks and loads per column (:func:`_tops`)."""
    top_ranks, top_values = tops
    c = loads.shape[1]
    first, first_rank = top_values[:, 0, :], top_ranks[:, 0, :]
    second = top_values[:, 1, :] if top_values.shape[1] > 1 else np.zeros_like(first)
    maxima = first.sum(axis=1)  # (n_mb,) each microstep's score
    k, a = divmod(source, dp)
    mine = np.flatnonzero(cells == source)
    x = costs[mine][:, None, :]
    options = []
    other = np.flatnonzero(cells != source)
    if other.size:
        y, targets = costs[other][None, :, :], cells[other]
        options.append((loads[source] - x + y, loads[targets][None] - y + x, targets, other))
    if mine.size > 1 and loads.shape[0] > 1:
        targets = np.delete(np.arange(loads.shape[0]), source)
        new_source = np.broadcast_to(loads[source] - x, (mine.size, targets.size, c))
        options.append((new_source, loads[targets][None] + x, targets, -1 - targets))
    best = None
    for new_source, new_target, targets, partners in options:
        kb, b = np.divmod(targets, dp)
        same = kb == k
        # the slowest other rank of each column: of microstep kb without b, of microstep k without
        # a (and without b for a partner in microstep k)
        rest_kb = np.where(b[:, None] == first_rank[kb], second[kb], first[kb])
        rest_k = np.tile(np.where(first_rank[k] == a, second[k], first[k]), (targets.size, 1))
        inside = np.flatnonzero(same)
        if inside.size:
            steps = np.full(inside.size, k)
            rest_k[inside] = _max_without(top_values, top_ranks, steps, np.full(inside.size, a), b[inside])
        in_k = np.maximum(new_source, rest_k[None])
        in_k = np.where(same[None, :, None], np.maximum(in_k, new_target), in_k).sum(axis=2)
        in_kb = np.where(same[None, :], 0.0, np.maximum(new_target, rest_kb[None]).sum(axis=2))
        gain = in_k + in_kb - maxima[k] - np.where(same, 0.0, maxima[kb])[None]
        potential = (new_source**2).sum(axis=2) + (new_target**2).sum(axis=2)
        potential = potential - float((loads[source] ** 2).sum()) - (loads[targets] ** 2).sum(axis=1)[None]
        flat_gain, flat_potential = gain.ravel(), potential.ravel()
        ties = np.flatnonzero(flat_gain == flat_gain.min())  # the first lowest potential among them
        flat = int(ties[np.argmin(flat_potential[ties])])
        i, j = divmod(flat, gain.shape[1])
        candidate = (float(flat_gain[flat]), float(flat_potential[flat]), int(mine[i]), int(partners[j]))
        if best is None or candidate[:2] < best[:2]:
            best = candidate
    return best


def _tops(loads: np.ndarray, dp: int) -> tuple[np.ndarray, np.ndarray]:
    """Each microstep's three most loaded ranks per column and their loads, ``(n_mb, <=3, c)`` each."""
    grid = loads.reshape(-1, dp, loads.shape[1])
    top_ranks = np.argsort(-grid, axis=1, kind="stable")[:, :3, :]
    return top_ranks, np.take_along_axis(grid, top_ranks, axis=1)


def improve_grid(costs: np.ndarray, cells: np.ndarray, dp: int, n_mb: int, rounds: int) -> np.ndarray:
    """``cells`` (``microstep * dp + rank`` of each row of ``costs``) improved by moves and swaps,
    within and across microsteps, out of the slowest rank of each microstep and column while they
    lower ``sum_k sum_c max_r`` (or keep it and lower the sum of squared cell loads); no cell is
    left empty. At most ``rounds`` changes, and none after :data:`PATIENCE` rounds without a
    lower score."""
    cells = cells.copy()
    loads = np.zeros((n_mb * dp, costs.shape[1]))
    np.add.at(loads, cells, costs)
    best_score, idle = np.inf, 0
    for _ in range(rounds):
        tops = _tops(loads, dp)
        score = float(tops[1][:, 0, :].sum())
        best_score, idle = (score, 0) if score < best_score * (1 - _EPS) else (best_score, idle + 1)
        if idle > PATIENCE:  # ties only: equal loads on many ranks need more than one change to gain
            break
        tolerance = _EPS * max(score, 1.0)
        least = _EPS * float((loads * loads).sum())
        change = None
        for source in _sources(tops, dp):  # the best change out of any of them
            found = _best_change(costs, cells, loads, tops, source, dp)
            if found is not None and (change is None or found[:2] < change[:2]):
                change = found
        if change is None or not (change[0] < -tolerance or (change[0] <= tolerance and change[1] < -least)):
            break
        _, _, row, partner = change
        source = int(cells[row])
        target = int(cells[partner]) if partner >= 0 else -1 - partner
        loads[source] -= costs[row]
        loads[target] += costs[row]
        cells[row] = target
        if partner >= 0:
            loads[target] -= costs[partner]
            loads[source] += costs[partner]
            cells[partner] = source
    return cells


def _sources(tops: tuple[np.ndarray, np.ndarray], dp: int) -> list[int]:
    """The cells holding a microstep's slowest rank of some column, in microstep then column order."""
    top_ranks = tops[0]
    cells = (np.arange(top_ranks.shape[0])[:, None] * dp + top_ranks[:, 0, :]).ravel()
    return list(dict.fromkeys(int(cell) for cell in cells))


def aligned_split(costs: np.ndarray, dp: int, n_mb: int, rounds: int = ROUNDS) -> list[list[list[int]]]:
    """``local[r][k]``: the rows of ``costs`` (``(n, c)``, ``n >= dp * n_mb``) in rank ``r``'s
    ``k``-th microbatch: grouped into microsteps by each key of :data:`GROUP_KEYS`
    (:func:`microstep_groups`) and balanced across ranks by differencing, the key whose start
    scores lowest (``sum_k sum_c max_r``; ties: the earlier key) then improved (:func:`improve_group`)."""
    matrix = np.asarray(costs, dtype=float)
    if matrix.ndim == 1:
        matrix = matrix[:, None]
    if matrix.shape[0] < dp * n_mb:
        raise ValueError(f"{matrix.shape[0]} samples cannot fill {n_mb} microbatches on each of {dp} ranks")
    best: tuple[float, np.ndarray] | None = None
    for cells in (*(_grouped(matrix, dp, n_mb, key) for key in GROUP_KEYS), ranked_cells(matrix, dp, n_mb)):
        score = _grid_score(matrix, cells, dp, n_mb)
        if best is None or score < best[0]:
            best = (score, cells)
    assert best is not None
    cells = improve_grid(matrix, best[1], dp, n_mb, min(rounds, max(ROUND_WORK // matrix.shape[0], 1)))
    rows = np.argsort(cells, kind="stable")
    ends = np.cumsum(np.bincount(cells, minlength=n_mb * dp))
    pieces = np.split(rows, ends[:-1])
    return [[pieces[k * dp + r].tolist() for k in range(n_mb)] for r in range(dp)]


def _grouped(costs: np.ndarray, dp: int, n_mb: int, key: str) -> np.ndarray:
    """Cells (``microstep * dp + rank``) of :func:`microstep_groups` by ``key``, each group
    balanced across ranks by equal-count vector differencing."""
    cells = np.empty(costs.shape[0], dtype=np.int64)
    for k, group in enumerate(microstep_groups(costs, n_mb, key)):
        cells[group] = k * dp + differencing_assign(costs[group], dp, equal_size=True)
    return cells


def ranked_cells(costs: np.ndarray, dp: int, n_mb: int) -> np.ndarray:
    """Cells of the rank-first start: rows balanced across ranks on their summed cost
    (equal-count vector differencing); each rank's rows, by decreasing summed cost, dealt to its
    ``n_mb`` microbatches in snake order (the largest with the smallest); each rank's
    microbatches then in decreasing encoder (first column) cost, so that microstep ``k`` holds
    every rank's ``k``-th heaviest. Many small samples even out across ranks this way better than
    in alike groups. Vectorised over ranks."""
    n = costs.shape[0]
    total = costs.sum(axis=1)
    ranks = differencing_assign(total[:, None], dp, equal_size=True)
    order = np.lexsort((np.arange(n), -total, ranks))  # by rank, then decreasing cost
    sorted_ranks = ranks[order]
    first_of_rank = np.searchsorted(sorted_ranks, np.arange(dp))
    seat = np.arange(n) - first_of_rank[sorted_ranks]  # position within its rank
    lap, slot = np.divmod(seat, n_mb)
    microbatch = np.empty(n, dtype=np.int64)
    microbatch[order] = np.where(lap % 2 == 0, slot, n_mb - 1 - slot)
    cells = ranks * n_mb + microbatch  # rank-major, for now
    loads = np.zeros((dp * n_mb, costs.shape[1]))
    np.add.at(loads, cells, costs)
    cell_ids = np.arange(dp * n_mb)
    heaviest = np.lexsort((cell_ids, -loads.sum(axis=1), -loads[:, 0], cell_ids // n_mb))
    step = np.empty(dp * n_mb, dtype=np.int64)
    step[heaviest] = np.tile(np.arange(n_mb), dp)  # within each rank, 0 = the heaviest
    return step[cells] * dp + ranks


def _grid_score(costs: np.ndarray, cells: np.ndarray, dp: int, n_mb: int) -> float:
    """``sum_k sum_c max_r`` of the cell loads."""
    loads = np.zeros((n_mb * dp, costs.shape[1]))
    np.add.at(loads, cells, costs)
    return float(loads.reshape(n_mb, dp, -1).max(axis=1).sum())
