"""``partition_batch``: split a global batch into balanced microbatches (DFLOP's scheduler).

The arguments become one :class:`~dflop_ds.schedule.partition_problem.PartitionProblem`;
:func:`solve` runs the candidate generators of :mod:`dflop_ds.schedule.candidates` in order
(the local search, the padding-aware starts, the exact ILP warm-started with the best so far)
and keeps the candidate with the smallest makespan under the problem's microbatch cost among
those within the memory cap. Items over the cap alone (with ``allow_oversize``) are set apart
first, and the chosen split is checked against the true microbatch memory last. Without a time
limit (``time_limit_s=0``: the heuristic alone, or the ILP within a node budget ``node_limit``)
everything is deterministic: no step looks at the clock.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from dflop_ds.schedule.candidates import GENERATORS, CandidateGenerator, exact_enabled, one_per_bucket
from dflop_ds.schedule.lower_bounds import as_cost_matrix, lower_bound
from dflop_ds.schedule.lpt import (
    InfeasibleError,
    MemoryCap,
    MicrobatchCost,
    bucket_loads,
    labels_to_buckets,
    true_times,
)
from dflop_ds.schedule.memory import memory_first_fit
from dflop_ds.schedule.partition_problem import (
    Candidate,
    MicrobatchMemory,
    PartitionProblem,
    buckets_to_labels,
)

#: A candidate replaces the best so far only when its makespan is lower by this relative margin.
SCORE_TOLERANCE = 1e-12

__all__ = ["Partition", "InfeasibleError", "partition_batch", "partition_from_buckets", "solve"]


@dataclasses.dataclass(frozen=True)
class Partition:
    """A split of ``n`` items into buckets.

    Attributes:
        buckets: item indices per bucket; every item exactly once, no bucket empty.
        makespan: the largest bucket cost over buckets and columns (by ``microbatch_cost`` when
            one was given, else the sum of the items' costs).
        lower_bound: a valid lower bound on the additive makespan of any split; it also bounds
            the true makespan when ``microbatch_cost`` is super-additive.
        solver: the generator that produced the split (:mod:`dflop_ds.schedule.candidates`):
            ``"lpt"``, ``"lpt+moves"``, ``"padded-lpt+moves"``, ``"padded-contiguous+moves"``,
            ``"ilp-optimal"`` (proved optimal) or ``"ilp-cbc"`` / ``"ilp-highs"`` (best found
            within the limits); ``"memory-first-fit"`` when the winner broke the true memory
            cap; ``"+alone"`` appended when items over the cap alone were set apart.
        additive_makespan: the makespan with summed item costs (equal to ``makespan`` without
            ``microbatch_cost``).
        bucket_costs: ``(n_buckets, k)`` cost of each bucket, as ``makespan`` measures it.
    """

    buckets: list[list[int]]
    makespan: float
    lower_bound: float
    solver: str
    additive_makespan: float = 0.0
    bucket_costs: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0, 1)), repr=False, compare=False)

    @property
    def ratio(self) -> float:
        """``makespan / lower_bound`` (1.0 is certified optimal); ``inf`` for a zero bound."""
        if self.lower_bound > 0:
            return self.makespan / self.lower_bound
        return 1.0 if self.makespan == 0 else float("inf")


def _within_true_memory(
    problem: PartitionProblem, best: Candidate | None, cap: MemoryCap, microbatch_memory: MicrobatchMemory
) -> Candidate | None:
    """``best`` if every bucket of two or more items is within ``cap`` by ``microbatch_memory``,
    else the memory-first fit (None if that fails too)."""
    if best is not None and all(
        len(b) < 2 or microbatch_memory(b) <= cap.cap for b in labels_to_buckets(best.labels, problem.n_buckets)
    ):
        return best
    key = cap.memory if problem.lengths is None else problem.lengths
    labels = memory_first_fit(problem.costs, key, problem.n_buckets, microbatch_memory, cap.cap)
    return None if labels is None else Candidate(labels, "memory-first-fit")


def _isolate(problem: PartitionProblem, cap: MemoryCap, alone: np.ndarray) -> Partition:
    """The split of ``problem`` with every item of ``alone`` (over ``cap`` by itself) in a bucket
    of its own and the other items split over the remaining buckets under ``cap``."""
    n, n_buckets = problem.costs.shape[0], problem.n_buckets
    rest = np.setdiff1d(np.arange(n), alone)
    free = n_buckets - alone.size
    if free < 0 or (free == 0 and rest.size):
        raise InfeasibleError(
            f"{alone.size} items (first: item {int(alone[0])}) each exceed memory_cap {cap.cap:g} alone"
            f" and need a bucket of their own, but the {n} items must fill exactly {n_buckets}"
            " buckets: the other items have none left"
        )
    buckets: list[list[int]] = []
    solver = "alone"
    if rest.size:
        cost, true_memory = problem.microbatch_cost, problem.microbatch_memory
        sub = solve(
            dataclasses.replace(
                problem,
                costs=problem.costs[rest],
                n_buckets=free,
                memory=MemoryCap(cap.memory[rest], cap.cap),
                microbatch_cost=None if cost is None else lambda positions: cost(rest[list(positions)].tolist()),
                lengths=None if problem.lengths is None else problem.lengths[rest],
                microbatch_memory=(
                    None if true_memory is None else lambda positions: true_memory(rest[list(positions)].tolist())
                ),
            )
        )
        buckets = [rest[b].tolist() for b in sub.buckets]
        solver = f"{sub.solver}+alone"
    buckets += [[int(i)] for i in alone]
    return partition_from_buckets(problem.costs, buckets, solver, problem.microbatch_cost)


def partition_from_buckets(
    costs: np.ndarray, buckets: list[list[int]], solver: str, microbatch_cost: MicrobatchCost | None = None
) -> Partition:
    """The :class:`Partition` of a given split (every item of ``costs`` in one of ``buckets``),
    its bucket costs measured as :func:`partition_batch` measures them."""
    matrix = as_cost_matrix(costs)
    labels = buckets_to_labels(buckets, matrix.shape[0])
    return _measured(matrix, labels, len(buckets), lower_bound(matrix, len(buckets)), solver, microbatch_cost)


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
    microbatch_memory: MicrobatchMemory | None = None,
) -> Partition:
    """Split items into ``n_buckets`` non-empty buckets minimising the makespan.

    The keyword form of ``solve(PartitionProblem(...))`` (note its default ``time_limit_s`` of
    1 s, where a :class:`PartitionProblem` defaults to the deterministic 0).

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
    cap = None
    if memory is not None or memory_cap is not None:
        if memory is None or memory_cap is None:
            raise ValueError("memory and memory_cap must be given together")
        cap = MemoryCap(np.asarray(memory), float(memory_cap))
    problem = PartitionProblem(
        costs,
        n_buckets,
        memory=cap,
        allow_oversize=allow_oversize,
        microbatch_cost=microbatch_cost,
        lengths=lengths,
        microbatch_memory=microbatch_memory,
        time_limit_s=time_limit_s,
        node_limit=node_limit,
        seed=seed,
    )
    return solve(problem)


def solve(problem: PartitionProblem, generators: Sequence[CandidateGenerator] = GENERATORS) -> Partition:
    """The best candidate of ``generators`` (by default
    :data:`~dflop_ds.schedule.candidates.GENERATORS`) for ``problem``.

    Each generator is run in turn with the best candidate so far; a candidate within the memory
    cap replaces it when its makespan (:meth:`PartitionProblem.score`) is lower by more than
    :data:`SCORE_TOLERANCE` (ties keep the earlier). With ``n`` items into ``n`` buckets the one
    possible split is taken without a search. Under ``allow_oversize`` the items over the cap
    alone first get a bucket each and the others are solved as a problem of their own. The
    winner is then checked against the true microbatch memory, when the problem has one (see
    :func:`partition_batch`).

    Raises:
        InfeasibleError: no candidate keeps every bucket under the memory cap.
    """
    cap = problem.memory
    if cap is not None and problem.allow_oversize:
        alone = np.flatnonzero(cap.memory > cap.cap)
        if alone.size:
            return _isolate(problem, cap, alone)
    if problem.costs.shape[0] == problem.n_buckets:
        return _partition(problem, one_per_bucket(problem))
    best, best_score = None, np.inf
    for generate in generators:
        for candidate in generate(problem, best):
            if not problem.fits(candidate.labels):
                continue
            value = problem.score(candidate.labels)
            if best is None or value < best_score * (1 - SCORE_TOLERANCE):
                best, best_score = candidate, value
    true_memory = problem.microbatch_memory
    if cap is not None and true_memory is not None:
        best = _within_true_memory(problem, best, cap, true_memory)
    if best is None:
        limit = np.inf if cap is None else cap.cap
        hint = (
            ""
            if exact_enabled(problem)
            else "; the exact solver was not run: raise dflop.sampler.ilp_nodes"
            " (dflop.sampler.time_limit_s also works, on a single process only)"
        )
        raise InfeasibleError(
            f"found no split of {problem.costs.shape[0]} items into {problem.n_buckets} buckets under"
            f" memory_cap {limit:g} (greedy placement failed{hint})"
        )
    return _partition(problem, best)


def _partition(problem: PartitionProblem, candidate: Candidate) -> Partition:
    """The :class:`Partition` of ``candidate``, checked to leave no bucket empty."""
    if np.bincount(candidate.labels, minlength=problem.n_buckets).min() == 0:  # guarded by construction
        raise AssertionError("partition produced an empty bucket")
    return _measured(
        problem.costs, candidate.labels, problem.n_buckets, problem.bound, candidate.solver, problem.microbatch_cost
    )


def _measured(
    costs: np.ndarray,
    labels: np.ndarray,
    n_buckets: int,
    bound: float,
    solver: str,
    microbatch_cost: MicrobatchCost | None,
) -> Partition:
    """The :class:`Partition` of ``labels``, its bucket costs measured by ``microbatch_cost`` when
    given (else summed)."""
    loads = bucket_loads(costs, labels, n_buckets)
    buckets = labels_to_buckets(labels, n_buckets)  # the bucket order bucket_loads uses
    measured = loads if microbatch_cost is None else true_times(buckets, microbatch_cost, costs.shape[1])
    return Partition(buckets, float(measured.max()), bound, solver, float(loads.max()), measured)
