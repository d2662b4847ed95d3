"""Local search on a split's true step, for microbatches whose cost is not the sum of their rows.

The DFLOP splitter builds its candidates from each row's own cost, columns that add up. A padded
microbatch (every row pays for the longest one) or a packed row whose attention spans the whole
row (its cost grows with the row's length squared) costs more than that sum, by an amount that
depends on which rows share it, so the best candidate by the rows' sums may be far from the best
split by the true cost. :func:`refine_split` improves a split by that true cost, for the sync
models whose ranks meet every microbatch (``microstep``, ``module``):

- a change moves one row of a *critical* microbatch (one that sets its microstep's maximum on
  some column) into another microbatch, or swaps it with
  a row of another microbatch, among the :data:`TARGETS` least loaded ranks of each microstep
  (all of them on small grids);
- each change is scored by the step under the sync model (:func:`~dflop_ds.sync.step_cost`),
  the two changed microbatches costed by the true microbatch cost (each grouping computed once);
- the first change that lowers the step is kept and the search starts again from the new
  critical microbatches, until no change lowers it, ``max_evaluations`` microbatch costs have
  been computed or :data:`TRIALS_PER_EVALUATION` times as many changes have been scored.

Pure and deterministic: critical microbatches in decreasing excess over their microstep's mean,
rows and targets in index order, no clock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np

from dflop_ds.sync import SyncModel, step_cost

__all__ = ["MAX_EVALUATIONS", "refine_split"]

#: Microbatch costs :func:`refine_split` computes at most per split (each a call of the true cost,
#: tens of microseconds for the packed and padded costs): bounds its time on large batches.
MAX_EVALUATIONS = 2_000
#: The least loaded ranks of each microstep whose microbatches a critical row may move to or
#: swap with (bounds a scan on thousands of ranks).
TARGETS = 8
#: Changes scored at most per microbatch cost computed (rescans score cached groupings again).
TRIALS_PER_EVALUATION = 16
#: A change must lower the step by more than this (relative) to be kept.
_GAIN = 1e-9

Grid = list[list[list[int]]]
Cell = tuple[int, int]


def refine_split(
    local: Sequence[Sequence[Sequence[int]]],
    predicted: np.ndarray,
    microbatch_cost: Callable[[Sequence[int]], np.ndarray],
    sync: SyncModel,
    fits: Callable[[Sequence[int]], bool] | None = None,
    max_evaluations: int = MAX_EVALUATIONS,
) -> tuple[Grid, np.ndarray]:
    """``local`` (``local[r][k]``: the rows of rank ``r``'s ``k``-th microbatch) and its
    ``(dp, n_mb, c)`` ``predicted`` costs, improved by moves and swaps of rows scored by
    ``microbatch_cost`` under ``sync`` (see the module docstring); ``fits``: whether a microbatch
    of two or more rows may be formed (e.g. under a memory cap; None: any). Returns the new grid
    and its predicted costs; every microbatch keeps at least one row."""
    if sync not in (SyncModel.MICROSTEP, SyncModel.MODULE):
        raise ValueError(f"refine_split balances ranks meeting every microbatch (microstep, module), not {sync.value}")
    grid: Grid = [[list(mb) for mb in rank] for rank in local]
    costs = np.array(predicted, dtype=float, copy=True)
    known: dict[tuple[int, ...], np.ndarray] = {}

    def cost_of(rows: list[int]) -> np.ndarray | None:
        key = tuple(sorted(rows))
        if key not in known:
            if len(known) >= max_evaluations:
                return None
            known[key] = np.asarray(microbatch_cost(list(key)), dtype=float).reshape(costs.shape[2])
        return known[key]

    step = step_cost(costs, sync)
    trials = [max_evaluations * TRIALS_PER_EVALUATION]
    while True:
        change = _first_gain(grid, costs, step, sync, cost_of, fits, trials)
        if change is None:
            return grid, costs
        (a, rows_a, cost_a), (b, rows_b, cost_b), step = change
        grid[a[0]][a[1]], grid[b[0]][b[1]] = rows_a, rows_b
        costs[a], costs[b] = cost_a, cost_b


def _first_gain(
    grid: Grid,
    costs: np.ndarray,
    step: float,
    sync: SyncModel,
    cost_of: Callable[[list[int]], np.ndarray | None],
    fits: Callable[[Sequence[int]], bool] | None,
    trials: list[int],
) -> tuple[tuple[Cell, list[int], np.ndarray], tuple[Cell, list[int], np.ndarray], float] | None:
    """The first move or swap out of a critical microbatch that lowers ``step``: the two changed
    cells with their rows and costs, and the new step; None when none does or a budget ran out
    (``trials[0]``: changes left to score, counted down)."""
    cells = _target_cells(costs)
    trial = costs.copy()
    current: dict[tuple[int, ...], float] = {}  # the step's share of each pair of microsteps, as it is
    for a in _critical_cells(costs, sync):
        source = grid[a[0]][a[1]]
        for i, row in enumerate(source):
            rest = source[:i] + source[i + 1 :]
            for b in cells:
                if b == a:
                    continue
                target = grid[b[0]][b[1]]
                for rows_a, rows_b in _changes(rest, row, target):
                    if fits is not None and not (_allowed(rows_a, fits) and _allowed(rows_b, fits)):
                        continue
                    cost_a, cost_b = cost_of(rows_a), cost_of(rows_b)
                    trials[0] -= 1
                    if cost_a is None or cost_b is None or trials[0] < 0:
                        return None
                    trial[a], trial[b] = cost_a, cost_b
                    steps = tuple(sorted({a[1], b[1]}))  # the microsteps the change touches
                    if steps not in current:
                        current[steps] = step_cost(costs[:, list(steps)], sync)
                    new = step - current[steps] + step_cost(trial[:, list(steps)], sync)
                    trial[a], trial[b] = costs[a], costs[b]
                    if new < step * (1 - _GAIN):
                        return (a, rows_a, cost_a), (b, rows_b, cost_b), new
    return None


def _changes(rest: list[int], row: int, target: list[int]) -> Iterator[tuple[list[int], list[int]]]:
    """The source's and target's rows after moving ``row`` (when the source keeps a row) and
    after swapping it with each row of ``target``."""
    if rest:
        yield rest, [*target, row]
    for j, other in enumerate(target):
        yield [*rest, other], [*target[:j], row, *target[j + 1 :]]


def _allowed(rows: list[int], fits: Callable[[Sequence[int]], bool]) -> bool:
    """A single row always forms a microbatch; more only when ``fits`` says so."""
    return len(rows) < 2 or fits(rows)


def _target_cells(costs: np.ndarray) -> list[Cell]:
    """The :data:`TARGETS` least loaded ranks (summed columns) of every microstep, in microstep
    order, least loaded first (ties by rank)."""
    loads = costs.sum(axis=2)
    return [(int(r), k) for k in range(loads.shape[1]) for r in np.argsort(loads[:, k], kind="stable")[:TARGETS]]


def _critical_cells(costs: np.ndarray, sync: SyncModel) -> list[Cell]:
    """The microbatches that set the step: under ``module`` the slowest rank of every microstep
    and column, under ``microstep`` of every microstep's summed column; in decreasing excess over
    their microstep's mean, ties by position."""
    columns = costs.sum(axis=2, keepdims=True) if sync is SyncModel.MICROSTEP else costs
    excess: dict[Cell, float] = {}
    for k in range(columns.shape[1]):
        for c in range(columns.shape[2]):
            loads = columns[:, k, c]
            r = int(np.argmax(loads))
            cell = (r, k)
            excess[cell] = max(excess.get(cell, 0.0), float(loads[r] - loads.mean()))
    return sorted(excess, key=lambda cell: (-excess[cell], cell))
