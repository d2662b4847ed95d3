"""``partition_batch``: split a global batch into balanced microbatches (DFLOP's scheduler).

Strategy: starting splits (vector Karmarkar-Karp differencing, then vector LPT if needed), one
sweep of pairwise re-splits, then moves, swaps and pair re-splits out of the slowest bucket
(vectorised: tens of milliseconds at 2048 items); then, only where it can help within the time
limit (small instances whose heuristic answer is not already at the lower bound), the exact ILP
warm-started with the heuristic's split. The best answer found is kept. Without a time limit
(``time_limit_s=0``: the heuristic alone, or the ILP within a node budget ``node_limit``)
everything is deterministic: no step looks at the clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from dflop_ds.schedule.lower_bounds import as_cost_matrix, lower_bound
from dflop_ds.schedule.lpt import (
    InfeasibleError,
    MemoryCap,
    MicrobatchCost,
    bucket_loads,
    differencing_assign,
    greedy_assign,
    improve,
    improve_with_cost,
    item_order,
    labels_to_buckets,
    pair_sweep,
    true_times,
)
from dflop_ds.schedule.memory import memory_first_fit
from dflop_ds.schedule.padded import padded_contiguous, padded_lpt

#: The ILP is skipped when the heuristic is within this relative gap of the lower bound.
OPTIMALITY_TOLERANCE = 1e-5
#: The local search stops (and no further start is tried) this close to the lower bound.
STOP_TOLERANCE = 1e-5
#: Largest ``n * n_buckets`` for which unconstrained differencing is tried as a start.
FREE_DIFFERENCING_MAX = 65_536
#: Sweeps of pairwise re-splits (slowest with fastest) that level a start before the search.
PAIR_SWEEPS = 1
#: How many of the lightest buckets the local search may re-split with the slowest one.
RESPLIT_PARTNERS = 32
#: Binary variables the ILP may have per second of time limit (beyond that it cannot help).
ILP_VARIABLES_PER_SECOND = 3000
#: Never build an ILP with more binary variables than this (model building itself is slow).
ILP_MAX_VARIABLES = 20_000

__all__ = ["Partition", "InfeasibleError", "partition_batch", "partition_from_buckets"]


@dataclass(frozen=True)
class Partition:
    """A split of ``n`` items into buckets.

    Attributes:
        buckets: item indices per bucket; every item exactly once, no bucket empty.
        makespan: the largest bucket cost over buckets and columns (by ``microbatch_cost`` when
            one was given, else the sum of the items' costs).
        lower_bound: a valid lower bound on the additive makespan of any split; it also bounds
            the true makespan when ``microbatch_cost`` is super-additive.
        solver: what produced the split: ``"lpt"``, ``"lpt+moves"``, ``"ilp-optimal"`` (proved
            optimal) or ``"ilp-cbc"`` / ``"ilp-highs"`` (best found within the time limit).
        additive_makespan: the makespan with summed item costs (equal to ``makespan`` without
            ``microbatch_cost``).
        bucket_costs: ``(n_buckets, k)`` cost of each bucket, as ``makespan`` measures it.
    """

    buckets: list[list[int]]
    makespan: float
    lower_bound: float
    solver: str
    additive_makespan: float = 0.0
    bucket_costs: np.ndarray = field(default_factory=lambda: np.zeros((0, 1)), repr=False, compare=False)

    @property
    def ratio(self) -> float:
        """``makespan / lower_bound`` (1.0 is certified optimal); ``inf`` for a zero bound."""
        if self.lower_bound > 0:
            return self.makespan / self.lower_bound
        return 1.0 if self.makespan == 0 else float("inf")


def _memory_cap(memory, memory_cap, n: int, n_buckets: int) -> MemoryCap | None:
    """Validate the memory arguments; raise naming the first item that cannot fit anywhere."""
    if memory is None and memory_cap is None:
        return None
    if memory is None or memory_cap is None:
        raise ValueError("memory and memory_cap must be given together")
    usage = np.asarray(memory, dtype=float).reshape(-1)
    if usage.shape != (n,):
        raise ValueError(f"memory must have one entry per item ({n}), got shape {np.shape(memory)}")
    cap = float(memory_cap)
    bad = np.flatnonzero(~np.isfinite(usage) | (usage < 0))
    if bad.size:
        raise ValueError(f"item {int(bad[0])} has invalid memory {usage[bad[0]]}")
    too_big = np.flatnonzero(usage > cap)
    if too_big.size:
        i = int(too_big[0])
        raise ValueError(f"item {i} needs memory {usage[i]:g} > memory_cap {cap:g}: it fits in no bucket")
    if usage.sum() > n_buckets * cap:
        raise InfeasibleError(
            f"items need {usage.sum():g} memory in total, more than {n_buckets} buckets x memory_cap {cap:g}"
        )
    return MemoryCap(usage, cap)


def _fits(labels: np.ndarray, n_buckets: int, memory: MemoryCap | None) -> bool:
    """Whether a labelling respects the memory cap (always true without one)."""
    if memory is None:
        return True
    return bool(np.bincount(labels, weights=memory.memory, minlength=n_buckets).max() <= memory.cap)


def _starts(costs: np.ndarray, n_buckets: int, seed: int, memory: MemoryCap | None):
    """Starting splits, best first: vector differencing (equal counts), differencing without
    the count constraint (small instances only: it costs ``O(n * n_buckets)``), vector LPT (by
    cost; under a memory cap, by memory when cost order fails). Yields only splits that
    respect the memory cap; may yield none."""
    kk = differencing_assign(costs, n_buckets, equal_size=True)
    if _fits(kk, n_buckets, memory):
        yield kk
    if costs.shape[0] * n_buckets <= FREE_DIFFERENCING_MAX:
        free = differencing_assign(costs, n_buckets, equal_size=False)
        if _fits(free, n_buckets, memory) and np.bincount(free, minlength=n_buckets).min() > 0:
            yield free
    try:
        yield greedy_assign(costs, n_buckets, item_order(costs, seed), memory)
        return
    except InfeasibleError:
        if memory is None:
            raise
    try:
        yield greedy_assign(costs, n_buckets, np.lexsort((-costs.max(axis=1), -memory.memory)), memory)
    except InfeasibleError:
        return


def _heuristic(
    costs: np.ndarray, n_buckets: int, seed: int, memory: MemoryCap | None, bound: float
) -> tuple[np.ndarray | None, str]:
    """Best improved start; later starts are tried only while the best is off the bound."""
    best, best_value, solver = None, np.inf, "lpt"
    target = bound * (1 + STOP_TOLERANCE)
    for start in _starts(costs, n_buckets, seed, memory):
        start_value = bucket_loads(costs, start, n_buckets).max()
        moved = start
        for _ in range(PAIR_SWEEPS):
            moved = pair_sweep(costs, moved, n_buckets, memory)
        moved = improve(costs, moved, n_buckets, memory, target=target, resplit=RESPLIT_PARTNERS)
        value = bucket_loads(costs, moved, n_buckets).max()
        if value < best_value:
            best, best_value = moved, value
            solver = "lpt+moves" if value < start_value else "lpt"
        if best_value <= target:
            break
    return best, solver


def _padded_candidates(matrix, lengths, n_buckets, cap, microbatch_cost, score, incumbent):
    """Try the padding-aware starts (then the non-additive moves); keep whichever scores best."""
    if lengths.shape != (matrix.shape[0],):
        raise ValueError(f"lengths must have one entry per item ({matrix.shape[0]}), got shape {lengths.shape}")
    best, best_score, solver = incumbent
    for name, build in (("padded-lpt", padded_lpt), ("padded-contiguous", padded_contiguous)):
        labels = buckets_to_labels(build(matrix, lengths, n_buckets), matrix.shape[0])
        if not _fits(labels, n_buckets, cap):
            continue
        if microbatch_cost is not None:
            labels = improve_with_cost(matrix, labels, n_buckets, microbatch_cost, cap)
        value = score(labels)
        if value < best_score * (1 - 1e-12):
            best, best_score, solver = labels, value, f"{name}+moves"
    return best, best_score, solver


def _exact_solver():
    """:func:`dflop_ds.schedule.ilp.solve_ilp`, imported only when an exact solve runs: PuLP is
    needed for ``time_limit_s`` / ``node_limit`` > 0, never for the heuristic."""
    try:
        from dflop_ds.schedule.ilp import solve_ilp
    except ImportError as error:
        raise ImportError(
            f"the exact solver (time_limit_s or node_limit > 0) needs PuLP ({error});"
            " pip install pulp, or set both to 0 for the heuristic"
        ) from error
    return solve_ilp


def _within_true_memory(
    best: np.ndarray | None,
    solver: str,
    matrix: np.ndarray,
    n_buckets: int,
    cap: MemoryCap,
    microbatch_memory: Callable[[list[int]], float],
    lengths: np.ndarray | None,
) -> tuple[np.ndarray | None, str]:
    """``best`` if every bucket of two or more items is within ``cap`` by ``microbatch_memory``,
    else the memory-first fit (None if that fails too)."""
    if best is not None and all(
        len(b) < 2 or microbatch_memory(b) <= cap.cap for b in labels_to_buckets(best, n_buckets)
    ):
        return best, solver
    key = cap.memory if lengths is None else np.asarray(lengths, dtype=float)
    return memory_first_fit(matrix, key, n_buckets, microbatch_memory, cap.cap), "memory-first-fit"


def _isolate(
    matrix: np.ndarray,
    n_buckets: int,
    alone: np.ndarray,
    memory: np.ndarray,
    cap: float,
    microbatch_cost: MicrobatchCost | None,
    lengths: np.ndarray | None,
    options: dict,
    microbatch_memory: Callable[[list[int]], float] | None = None,
) -> Partition:
    """:func:`partition_batch` with every item of ``alone`` (over ``cap`` by itself) in a bucket of
    its own and the other items split over the remaining buckets under ``cap``."""
    n = matrix.shape[0]
    rest = np.setdiff1d(np.arange(n), alone)
    free = n_buckets - alone.size
    if free < 0 or (free == 0 and rest.size):
        raise InfeasibleError(
            f"{alone.size} items (first: item {int(alone[0])}) each exceed memory_cap {cap:g} alone"
            f" and need a bucket of their own, but the {n} items must fill exactly {n_buckets}"
            " buckets: the other items have none left"
        )
    buckets: list[list[int]] = []
    solver = "alone"
    if rest.size:
        sub_cost, sub_memory = None, None
        if microbatch_cost is not None:
            sub_cost = lambda positions: microbatch_cost(rest[list(positions)].tolist())  # noqa: E731
        if microbatch_memory is not None:
            sub_memory = lambda positions: microbatch_memory(rest[list(positions)].tolist())  # noqa: E731
        sub = partition_batch(
            matrix[rest],
            free,
            memory=memory[rest],
            memory_cap=cap,
            microbatch_cost=sub_cost,
            lengths=None if lengths is None else lengths[rest],
            microbatch_memory=sub_memory,
            **options,
        )
        buckets = [rest[b].tolist() for b in sub.buckets]
        solver = f"{sub.solver}+alone"
    buckets += [[int(i)] for i in alone]
    return partition_from_buckets(matrix, buckets, solver, microbatch_cost)


def partition_from_buckets(
    costs: np.ndarray, buckets: list[list[int]], solver: str, microbatch_cost: MicrobatchCost | None = None
) -> Partition:
    """The :class:`Partition` of a given split (every item of ``costs`` in one of ``buckets``),
    its bucket costs measured as :func:`partition_batch` measures them."""
    matrix = as_cost_matrix(costs)
    n_buckets = len(buckets)
    labels = buckets_to_labels(buckets, matrix.shape[0])
    loads = bucket_loads(matrix, labels, n_buckets)
    order = labels_to_buckets(labels, n_buckets)  # the bucket order bucket_loads uses
    measured = loads if microbatch_cost is None else true_times(order, microbatch_cost, matrix.shape[1])
    return Partition(order, float(measured.max()), lower_bound(matrix, n_buckets), solver, float(loads.max()), measured)


def buckets_to_labels(buckets: list[list[int]], n: int) -> np.ndarray:
    """Bucket lists -> ``labels[item] = bucket``."""
    labels = np.empty(n, dtype=np.int64)
    for b, items in enumerate(buckets):
        labels[items] = b
    return labels


def partition_batch(
    costs: np.ndarray,
    n_buckets: int,
    *,
    memory: np.ndarray | None = None,
    memory_cap: float | None = None,
    time_limit_s: float = 1.0,
    seed: int = 0,
    microbatch_cost: MicrobatchCost | None = None,
    lengths: np.ndarray | None = None,
    node_limit: int = 0,
    allow_oversize: bool = False,
    microbatch_memory: Callable[[list[int]], float] | None = None,
) -> Partition:
    """Split items into ``n_buckets`` non-empty buckets minimising the makespan.

    Args:
        costs: ``(n, k)`` per-item costs (e.g. ``[encoder, llm]`` seconds); 1-D means ``k = 1``.
            Columns are compared as they are, so they should share a unit.
        n_buckets: number of buckets (microbatches x data-parallel ranks); at most ``n``.
        memory: ``(n,)`` per-item memory; with ``memory_cap``, no bucket may exceed the cap.
        memory_cap: per-bucket memory cap.
        time_limit_s: time the exact ILP may take (0 runs the heuristic only, which is
            deterministic; a time-limited ILP may return different splits on different runs
            unless it proves optimality).
        seed: orders equal items in the heuristic and seeds the solver.
        microbatch_cost: optional ``callable(list of item indices) -> (k,)`` true cost of a
            bucket (padding, attention); when given, the improving moves use it and ``makespan``
            is measured with it.
        lengths: optional ``(n,)`` padded dimension of each item (e.g. LLM sequence length) when
            ``microbatch_cost`` pads every item to the bucket's longest: padding-aware starts
            (:mod:`dflop_ds.schedule.padded`) then compete with the additive ones.
        node_limit: branch-and-bound nodes the exact ILP may explore (0: none). With
            ``time_limit_s=0`` the solve never looks at the clock, so every process computing
            the same batch gets the same split: the exact solver for multi-rank training.
        allow_oversize: an item whose ``memory`` alone exceeds ``memory_cap`` gets a bucket of
            its own (the other items are split over the remaining buckets under the cap)
            instead of raising.
        microbatch_memory: optional ``callable(list of item indices) -> bytes`` true memory of a
            bucket (e.g. padded to its longest item), where ``memory`` (per item, summed) only
            bounds it from below. With ``memory_cap``, an answer with a bucket of two or more
            items above the cap by it is replaced by :func:`~dflop_ds.schedule.memory.memory_first_fit`
            (items by ``lengths``, else ``memory``, decreasing), or refused.

    Raises:
        ValueError: bad shapes or values, ``n < n_buckets``, or an item alone over the cap
            (unless ``allow_oversize``).
        InfeasibleError: (a ``ValueError``) no split respects the memory cap, or more items
            exceed the cap alone than there are buckets.
    """
    matrix = as_cost_matrix(costs)
    n, k = matrix.shape
    if int(n_buckets) != n_buckets or n_buckets < 1:
        raise ValueError(f"n_buckets must be a positive integer, got {n_buckets}")
    n_buckets = int(n_buckets)
    if n < n_buckets:
        raise ValueError(f"cannot fill {n_buckets} buckets with {n} items: no bucket may be empty")
    if time_limit_s < 0:
        raise ValueError(f"time_limit_s must be >= 0, got {time_limit_s}")
    if int(node_limit) != node_limit or node_limit < 0:
        raise ValueError(f"node_limit must be a non-negative integer, got {node_limit}")
    if allow_oversize and memory is not None and memory_cap is not None and np.shape(memory) == (n,):
        usage = np.asarray(memory, dtype=float)
        alone = np.flatnonzero(usage > float(memory_cap))
        if alone.size:
            options = dict(time_limit_s=time_limit_s, seed=seed, node_limit=node_limit)
            return _isolate(
                matrix,
                n_buckets,
                alone,
                usage,
                float(memory_cap),
                microbatch_cost,
                None if lengths is None else np.asarray(lengths, dtype=float),
                options,
                microbatch_memory,
            )
    cap = _memory_cap(memory, memory_cap, n, n_buckets)
    bound = lower_bound(matrix, n_buckets)
    if n == n_buckets:
        # One item per bucket: the only split. The search below would keep its first start
        # (no move, swap or re-split of single items lowers the makespan), so take that start.
        return _partition(matrix, differencing_assign(matrix, n_buckets), n_buckets, bound, "lpt", microbatch_cost)
    started = time.perf_counter()

    def score(labels: np.ndarray) -> float:
        if microbatch_cost is None:
            return float(bucket_loads(matrix, labels, n_buckets).max())
        return float(true_times(labels_to_buckets(labels, n_buckets), microbatch_cost, k).max())

    best, solver = _heuristic(matrix, n_buckets, seed, cap, bound)
    best_score = np.inf
    if best is not None:
        best_score = score(best)
        if microbatch_cost is not None:
            moved = improve_with_cost(matrix, best, n_buckets, microbatch_cost, cap)
            moved_score = score(moved)
            if moved_score < best_score:
                best, best_score, solver = moved, moved_score, "lpt+moves"

    if lengths is not None:
        best, best_score, solver = _padded_candidates(
            matrix, np.asarray(lengths, dtype=float), n_buckets, cap, microbatch_cost, score, (best, best_score, solver)
        )

    additive = float(bucket_loads(matrix, best, n_buckets).max()) if best is not None else np.inf
    variables = n * n_buckets
    timed = time_limit_s > 0
    ilp_helps = (
        (timed or node_limit > 0)
        and additive > bound * (1 + OPTIMALITY_TOLERANCE)
        and variables
        <= (min(ILP_MAX_VARIABLES, ILP_VARIABLES_PER_SECOND * time_limit_s) if timed else ILP_MAX_VARIABLES)
    )
    if ilp_helps:
        solve_ilp = _exact_solver()
        remaining = max(time_limit_s - (time.perf_counter() - started), 0.05) if timed else 0.0
        result = solve_ilp(
            matrix,
            n_buckets,
            item_order(matrix, seed),
            lower=bound,
            upper=None if best is None else additive * (1 + 1e-9),
            warm_labels=best,
            time_limit_s=remaining,
            seed=seed,
            memory=cap,
            node_limit=int(node_limit),
        )
        if result.infeasible and best is None:
            raise InfeasibleError(
                f"no split of {n} items into {n_buckets} buckets keeps every bucket under memory_cap {memory_cap:g}"
            )
        if result.labels is not None:
            candidate = result.labels
            if microbatch_cost is not None:
                candidate = improve_with_cost(matrix, candidate, n_buckets, microbatch_cost, cap)
            candidate_score = score(candidate)
            if candidate_score < best_score * (1 - 1e-12) or best is None:
                best, best_score = candidate, candidate_score
                solver = "ilp-optimal" if result.optimal and microbatch_cost is None else f"ilp-{result.solver}"
    if cap is not None and microbatch_memory is not None:
        best, solver = _within_true_memory(best, solver, matrix, n_buckets, cap, microbatch_memory, lengths)
    if best is None:
        hint = (
            ""
            if ilp_helps
            else "; the exact solver was not run: raise dflop.sampler.ilp_nodes"
            " (dflop.sampler.time_limit_s also works, on a single process only)"
        )
        raise InfeasibleError(
            f"found no split of {n} items into {n_buckets} buckets under memory_cap {memory_cap:g}"
            f" (greedy placement failed{hint})"
        )
    return _partition(matrix, best, n_buckets, bound, solver, microbatch_cost)


def _partition(
    matrix: np.ndarray,
    labels: np.ndarray,
    n_buckets: int,
    bound: float,
    solver: str,
    microbatch_cost: MicrobatchCost | None,
) -> Partition:
    """The :class:`Partition` of ``labels``, its bucket costs measured by ``microbatch_cost`` when given."""
    buckets = labels_to_buckets(labels, n_buckets)
    if any(not bucket for bucket in buckets):  # guarded by construction; never silently wrong
        raise AssertionError("partition produced an empty bucket")
    loads = bucket_loads(matrix, labels, n_buckets)
    measured = loads if microbatch_cost is None else true_times(buckets, microbatch_cost, matrix.shape[1])
    return Partition(buckets, float(measured.max()), bound, solver, float(loads.max()), measured)
