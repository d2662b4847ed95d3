"""DFLOP's split: the candidate with the smallest step under the request's sync model.

:class:`DFLOPSplitter` is registered as ``"dflop"``.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from dflop_ds.schedule import partition as partitioner
from dflop_ds.schedule.aligned import ROUNDS, aligned_split
from dflop_ds.schedule.lpt import InfeasibleError, MemoryCap, MicrobatchCost
from dflop_ds.schedule.partition_problem import PartitionProblem
from dflop_ds.schedule.ranks import assign_to_ranks, lockstep_order
from dflop_ds.schedule.refine import refine_split
from dflop_ds.schedule.splitters.base import MemoryBudget, SplitRequest, SplitResult, register_splitter
from dflop_ds.sync import SyncModel

logger = logging.getLogger(__name__)
#: Suffix of ``SplitResult.solver`` when the exact solver failed and the heuristic answered.
FALLBACK_SUFFIX = "+fallback"
#: Suffix of ``SplitResult.solver`` when the true-cost local search improved the best candidate.
REFINED_SUFFIX = "+refined"
#: Splits under a memory budget, re-weighting the bytes charged to rows of over-cap microbatches.
MEMORY_ROUNDS = 16
_warned_fallback: set[str] = set()


@register_splitter("dflop")
class DFLOPSplitter:
    """DFLOP's split, minimising the step under the request's sync model (:mod:`dflop_ds.sync`).

    Candidates, each scored by the request's step (:meth:`SplitRequest.step`), the best kept
    (ties: the earlier one):

    - the partitioner's ``n_mb * dp`` balanced microbatches
      (:func:`~dflop_ds.schedule.partition.solve` of a
      :class:`~dflop_ds.schedule.partition_problem.PartitionProblem`) put onto ranks as the sync model
      needs: ``pipeline`` balances the slowest microbatch on every column and orders each rank
      for 1F1B (:func:`~dflop_ds.schedule.ranks.assign_to_ranks`, the only candidate there);
      ``boundary`` balances the summed columns (encoder and LLM run one after the other) and the
      rank totals, in any order; ``microstep`` and ``module`` give microbatch ``k`` of every rank
      a similar summed cost (:func:`~dflop_ds.schedule.ranks.lockstep_order`);
    - under ``microstep`` (on the summed column) and ``module`` (on each column), the
      microstep-aligned split of :func:`~dflop_ds.schedule.aligned.aligned_split`; under a
      memory budget only when within its cap.

    When the request's ``microbatch_cost`` is not the sum of the rows (padded text, a packed row
    attended as one sequence) and ranks meet every microbatch (``microstep``, ``module``), the best candidate is then
    improved by moves and swaps scored by that true cost
    (:func:`~dflop_ds.schedule.refine.refine_split`).

    The request's ``microbatch_cost`` gives a microbatch's true (e.g. padded) cost; its
    ``lengths`` enable the padding-aware starts when that cost pads to the longest sample; its
    ``memory`` budget caps every microbatch (see :meth:`split`). ``time_limit_s`` and
    ``node_limit`` bound the exact solver (both 0: heuristic only); ``search_rounds`` bounds the
    aligned split's local search (:data:`~dflop_ds.schedule.aligned.ROUNDS`; 0: its best start
    alone, a few times faster, for a planner's inner loop). Ranks computing the split
    independently need a deterministic answer: no time limit (the heuristic, or the ILP within
    ``node_limit`` nodes).
    """

    name = "dflop"

    def __init__(self, time_limit_s: float = 0.0, node_limit: int = 0, search_rounds: int = ROUNDS) -> None:
        self.time_limit_s = float(time_limit_s)
        self.node_limit = int(node_limit)
        self.search_rounds = int(search_rounds)

    def split(self, request: SplitRequest) -> SplitResult:
        """The split of ``request``'s batch with the smallest predicted step.

        Under a memory budget the partitioner keeps each microbatch's summed per-row bytes under
        the cap. A padded microbatch (whose rows all pay for its longest sample) may still be
        predicted above it: the bytes charged to its rows are then raised by its overshoot
        (predicted / cap) and the batch is split again, at most :data:`MEMORY_ROUNDS` times (a
        multiplicative re-weighting: rows that keep landing in over-cap microbatches get pushed
        apart; a row charged above the cap alone gets a microbatch of its own). The last try has
        the partitioner check every microbatch's predicted bytes itself and fall back to a
        length-ordered first fit; an :class:`~dflop_ds.schedule.partition.InfeasibleError` when
        that fails too. A row above the cap alone is a ``ValueError`` naming it unless the
        budget's ``allow_oversize``.
        """
        budget = request.memory
        if budget is None:
            return self._best(request, None, None, checked=False)
        oversize = np.flatnonzero(budget.rows > budget.cap)
        if oversize.size and not budget.allow_oversize:
            row = int(oversize[0])
            raise ValueError(
                f"sample {request.batch[row]} (row {row} of the batch) needs {budget.rows[row]:.4g} bytes alone,"
                f" over the memory cap of {budget.cap:.4g} bytes; allow_oversize trains it alone"
            )
        free = dataclasses.replace(request, memory=None)  # the candidates are checked here
        usage = budget.rows.copy()
        for _ in range(MEMORY_ROUNDS - 1):
            try:
                result = self._best(free, budget, usage, checked=False)
            except InfeasibleError:
                break  # the charges outgrew the microbatches: let the last try decide
            over = budget.over(_positions(request, result))
            if not over:
                return _under_budget(request, result)
            for microbatch, size in over:
                usage[microbatch] *= size / budget.cap * (1 + 1e-9)
        return _under_budget(request, self._best(free, budget, budget.rows, checked=True))

    def split_buckets(self, request: SplitRequest, buckets: list[list[int]], solver: str) -> SplitResult:
        """``request``'s batch split into the given ``n_mb * dp`` microbatches (lists of batch rows),
        put onto ranks as :meth:`split` puts the partitioner's."""
        matrix, microbatch_cost = _balanced_costs(request)
        partition = partitioner.partition_from_buckets(matrix, buckets, solver, microbatch_cost)
        return self._onto_ranks(request, partition, solver)

    def _best(
        self, request: SplitRequest, budget: MemoryBudget | None, usage: np.ndarray | None, checked: bool
    ) -> SplitResult:
        """The best candidate (see the class docstring) under ``budget``; ``usage``: the bytes
        charged to each row; ``checked``: the partitioner checks true microbatch bytes."""
        best = self._partitioned(request, budget, usage, checked)
        if request.sync in (SyncModel.MICROSTEP, SyncModel.MODULE):
            columns = request.costs.sum(axis=1, keepdims=True) if request.sync is SyncModel.MICROSTEP else request.costs
            local = aligned_split(columns, request.dp, request.n_mb, self.search_rounds)
            if budget is None or not budget.over(local):
                predicted = request.predict(local)
                if request.step(predicted) < best.step:
                    best = request.result(local, "aligned", predicted)
        if request.microbatch_cost is not None and request.sync in (SyncModel.MICROSTEP, SyncModel.MODULE):
            best = _refined(request, best, budget)
        return best

    def _partitioned(
        self, request: SplitRequest, budget: MemoryBudget | None, usage: np.ndarray | None, checked: bool
    ) -> SplitResult:
        """The partitioner's microbatches under ``budget``, put onto ranks for the request's sync model."""
        matrix, microbatch_cost = _balanced_costs(request)
        problem = PartitionProblem(
            matrix,
            request.n_mb * request.dp,
            memory=None if budget is None or usage is None else MemoryCap(usage, budget.cap),
            allow_oversize=True,  # a row charged over the cap gets a microbatch of its own (checked in split)
            microbatch_cost=microbatch_cost,
            lengths=None if request.lengths is None else np.asarray(request.lengths, float),
            microbatch_memory=budget.microbatch if budget is not None and checked else None,
            time_limit_s=self.time_limit_s,
            node_limit=self.node_limit,
            seed=request.seed,
        )
        partition, solver = _partition_or_fallback(problem)
        return self._onto_ranks(request, partition, solver)

    def _onto_ranks(self, request: SplitRequest, partition: partitioner.Partition, solver: str) -> SplitResult:
        """Assign ``partition``'s microbatches to ranks and order them for the request's sync model."""
        if request.sync is SyncModel.PIPELINE:
            order = assign_to_ranks(partition.bucket_costs, request.dp, request.n_mb)
        elif request.sync is SyncModel.BOUNDARY:
            order = assign_to_ranks(partition.bucket_costs.sum(axis=1), request.dp, request.n_mb)
        else:
            order = lockstep_order(partition.bucket_costs, request.dp, request.n_mb)
        local = [[partition.buckets[b] for b in rank] for rank in order]  # result() copies them
        if request.sync is SyncModel.PIPELINE:
            predicted = partition.bucket_costs[np.asarray(order)]
            return request.result(local, solver, predicted, float(partition.lower_bound))
        return request.result(local, solver)


def _balanced_costs(request: SplitRequest) -> tuple[np.ndarray, MicrobatchCost | None]:
    """The cost matrix and microbatch cost the partitioner balances: every column under a
    pipeline (each paces its own stages), their sum otherwise (encoder and LLM run one after the
    other on every rank)."""
    if request.sync is SyncModel.PIPELINE:
        return request.costs, request.microbatch_cost
    columns = request.microbatch_cost
    summed = None
    if columns is not None:
        summed = lambda positions: np.atleast_1d(np.asarray(columns(positions), dtype=float).sum())  # noqa: E731
    return request.costs.sum(axis=1, keepdims=True), summed


def _refined(request: SplitRequest, best: SplitResult, budget: MemoryBudget | None) -> SplitResult:
    """``best`` improved by moves and swaps scored by the request's true microbatch cost
    (:func:`~dflop_ds.schedule.refine.refine_split`), within ``budget``; ``best`` itself when
    nothing lowers its step."""
    fits = None if budget is None else (lambda rows: budget.bytes_of(rows) <= budget.cap)
    assert request.microbatch_cost is not None
    local, predicted = refine_split(
        _positions(request, best), best.predicted, request.microbatch_cost, request.sync, fits
    )
    if request.step(predicted) >= best.step:
        return best
    return request.result(local, f"{best.solver}{REFINED_SUFFIX}", predicted)


def _under_budget(request: SplitRequest, result: SplitResult) -> SplitResult:
    """``result`` (of the request without its budget) as ``request``'s, checked against its budget."""
    return request.result(_positions(request, result), result.solver, result.predicted, result.lower_bound)


def _positions(request: SplitRequest, result: SplitResult) -> list[list[list[int]]]:
    """``result``'s microbatches as rows of ``request`` (its ranks hold dataset indices)."""
    row = {int(index): p for p, index in enumerate(request.batch)}
    return [[[row[i] for i in mb] for mb in rank] for rank in result.ranks]


def _partition_or_fallback(problem: PartitionProblem) -> tuple[partitioner.Partition, str]:
    """The partitioner's split of ``problem``, falling back to its heuristic alone when the exact
    solver fails.

    Bad input (a ``ValueError``, e.g. a negative or NaN cost) is raised as is. Any other error
    with the solver enabled (a PuLP error, a missing CBC binary, an OS error starting it) is
    logged once per error type and answered by the deterministic heuristic; ``solver`` then
    ends in :data:`FALLBACK_SUFFIX`. Returns ``(partition, solver)``.
    """
    try:
        partition = partitioner.solve(problem)
        return partition, partition.solver
    except ValueError:
        raise
    except Exception as error:  # noqa: BLE001 - any solver failure must not stop training
        if problem.time_limit_s <= 0 and problem.node_limit <= 0:
            raise
        kind = type(error).__name__
        if kind not in _warned_fallback:
            _warned_fallback.add(kind)
            logger.warning(
                "exact partition solver failed (%s: %s); using the heuristic split instead "
                "(logged once per error type)",
                kind,
                error,
            )
    partition = partitioner.solve(dataclasses.replace(problem, time_limit_s=0.0, node_limit=0))
    return partition, partition.solver + FALLBACK_SUFFIX
