"""The partitioner's candidate generators: each proposes splits of a :class:`PartitionProblem`.

Every generator has one signature, ``generate(problem, best) -> Iterator[Candidate]``: ``best``
is the best candidate scored so far (None before the first), which a generator may start from
(the exact solver is warm-started with it) or use to decide it cannot help. A generator does
not choose among its proposals by the problem's score (the local search keeps its best start by
the additive makespan its moves lower); :func:`dflop_ds.schedule.partition.solve` scores every
proposal, running the generators in the order of :data:`GENERATORS`:

- :func:`local_search`: starting splits (vector Karmarkar-Karp differencing, then vector LPT),
  pairwise re-splits, then moves, swaps and pair re-splits out of the slowest bucket, all on the
  additive costs; its best split, then that split improved under the true microbatch cost;
- :func:`padded_starts`: the padding-aware starts (:mod:`dflop_ds.schedule.padded`) when the
  problem has lengths, improved under the true microbatch cost;
- :func:`exact`: the ILP (:mod:`dflop_ds.schedule.ilp`, through PuLP) warm-started with the best
  split, when it can help within the time or node limit.

Each generator is a function of its arguments alone; without a time limit none looks at the
clock, so every process computing the same batch gets the same proposals.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import numpy as np

from dflop_ds.schedule.lpt import (
    InfeasibleError,
    MemoryCap,
    bucket_loads,
    differencing_assign,
    greedy_assign,
    improve,
    improve_with_cost,
    item_order,
    pair_sweep,
)
from dflop_ds.schedule.padded import padded_contiguous, padded_lpt
from dflop_ds.schedule.partition_problem import Candidate, PartitionProblem, buckets_to_labels, fits

#: The exact solver is skipped when the best split is within this relative gap of the lower bound.
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

#: A candidate generator: proposals for a problem, given the best candidate so far (None before the first).
CandidateGenerator = Callable[[PartitionProblem, Candidate | None], Iterator[Candidate]]


def one_per_bucket(problem: PartitionProblem) -> Candidate:
    """The only split of ``n`` items into ``n`` buckets (no search can change it)."""
    return Candidate(differencing_assign(problem.costs, problem.n_buckets), "lpt")


def local_search(problem: PartitionProblem, best: Candidate | None) -> Iterator[Candidate]:
    """The best improved start by the additive makespan (later starts are tried only while the
    best is off the lower bound), then, with a microbatch cost, that split improved under it."""
    costs, n_buckets, memory = problem.costs, problem.n_buckets, problem.memory
    found, found_value, solver = None, np.inf, "lpt"
    target = problem.bound * (1 + STOP_TOLERANCE)
    for start in _starts(costs, n_buckets, problem.seed, memory):
        start_value = bucket_loads(costs, start, n_buckets).max()
        moved = start
        for _ in range(PAIR_SWEEPS):
            moved = pair_sweep(costs, moved, n_buckets, memory)
        moved = improve(costs, moved, n_buckets, memory, target=target, resplit=RESPLIT_PARTNERS)
        value = bucket_loads(costs, moved, n_buckets).max()
        if value < found_value:
            found, found_value = moved, value
            solver = "lpt+moves" if value < start_value else "lpt"
        if found_value <= target:
            break
    if found is None:
        return
    yield Candidate(found, solver)
    if problem.microbatch_cost is not None:
        yield Candidate(_cost_moves(problem, found), "lpt+moves")


def padded_starts(problem: PartitionProblem, best: Candidate | None) -> Iterator[Candidate]:
    """The padding-aware starts (longest-first LPT, contiguous runs by length) that fit the
    memory cap, each improved under the microbatch cost; nothing without lengths."""
    if problem.lengths is None:
        return
    n = problem.costs.shape[0]
    for name, build in (("padded-lpt", padded_lpt), ("padded-contiguous", padded_contiguous)):
        labels = buckets_to_labels(build(problem.costs, problem.lengths, problem.n_buckets), n)
        if problem.fits(labels):
            yield Candidate(_cost_moves(problem, labels), f"{name}+moves")


def exact(problem: PartitionProblem, best: Candidate | None) -> Iterator[Candidate]:
    """The ILP's split, warm-started with ``best``, improved under the microbatch cost; nothing
    when :func:`exact_enabled` is false or ``best`` is already within
    :data:`OPTIMALITY_TOLERANCE` of the lower bound. Raises :class:`InfeasibleError` when the
    solver proves the memory cap infeasible and there is no ``best``."""
    additive = np.inf if best is None else problem.additive(best.labels)
    if not exact_enabled(problem) or additive <= problem.bound * (1 + OPTIMALITY_TOLERANCE):
        return
    solve_ilp = _exact_solver()
    timed = problem.time_limit_s > 0
    remaining = max(problem.deadline - time.perf_counter(), 0.05) if timed else 0.0
    result = solve_ilp(
        problem.costs,
        problem.n_buckets,
        item_order(problem.costs, problem.seed),
        lower=problem.bound,
        upper=None if best is None else additive * (1 + 1e-9),
        warm_labels=None if best is None else best.labels,
        time_limit_s=remaining,
        seed=problem.seed,
        memory=problem.memory,
        node_limit=int(problem.node_limit),
    )
    if result.infeasible and best is None:
        cap = problem.memory.cap if problem.memory is not None else np.inf
        raise InfeasibleError(
            f"no split of {problem.costs.shape[0]} items into {problem.n_buckets} buckets keeps every"
            f" bucket under memory_cap {cap:g}"
        )
    if result.labels is not None:
        optimal = result.optimal and problem.microbatch_cost is None
        yield Candidate(_cost_moves(problem, result.labels), "ilp-optimal" if optimal else f"ilp-{result.solver}")


#: The generators :func:`dflop_ds.schedule.partition.solve` runs, in order.
GENERATORS: tuple[CandidateGenerator, ...] = (local_search, padded_starts, exact)


def exact_enabled(problem: PartitionProblem) -> bool:
    """Whether the problem's limits let the exact solver run at its size: a time or node limit,
    and at most :data:`ILP_MAX_VARIABLES` (or :data:`ILP_VARIABLES_PER_SECOND` per second of a
    time limit) binary variables."""
    timed = problem.time_limit_s > 0
    if not timed and problem.node_limit <= 0:
        return False
    limit = min(ILP_MAX_VARIABLES, ILP_VARIABLES_PER_SECOND * problem.time_limit_s) if timed else ILP_MAX_VARIABLES
    return problem.costs.shape[0] * problem.n_buckets <= limit


def _starts(costs: np.ndarray, n_buckets: int, seed: int, memory: MemoryCap | None) -> Iterator[np.ndarray]:
    """Starting splits, best first: vector differencing (equal counts), differencing without
    the count constraint (small instances only: it costs ``O(n * n_buckets)``), vector LPT (by
    cost; under a memory cap, by memory when cost order fails). Yields only splits that
    respect the memory cap; may yield none."""
    kk = differencing_assign(costs, n_buckets, equal_size=True)
    if fits(kk, n_buckets, memory):
        yield kk
    if costs.shape[0] * n_buckets <= FREE_DIFFERENCING_MAX:
        free = differencing_assign(costs, n_buckets, equal_size=False)
        if fits(free, n_buckets, memory) and np.bincount(free, minlength=n_buckets).min() > 0:
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


def _cost_moves(problem: PartitionProblem, labels: np.ndarray) -> np.ndarray:
    """``labels`` improved by moves and swaps under the true microbatch cost (as they are without one)."""
    if problem.microbatch_cost is None:
        return labels
    return improve_with_cost(problem.costs, labels, problem.n_buckets, problem.microbatch_cost, problem.memory)


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
