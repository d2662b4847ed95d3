"""Re-implementations of the microbatch splits users would pick instead of DFLOP's.

Each baseline maps a global batch of ``n`` items to ``n_buckets`` buckets and returns
``list[list[int]]`` (item indices per bucket), the format of ``Partition.buckets``. They are
written from the published descriptions of each system (see docs in each function); none is
tuned beyond what the original does. The ones a run can train with (stock, LLaVA's, verl's)
are the library's registered splitters (:mod:`dflop_ds.schedule.splitters`), re-exported here.
"""

from __future__ import annotations

import heapq
import time

import numpy as np

from dflop_ds.schedule.splitters import SplitRequest, make_splitter
from dflop_ds.schedule.splitters.llava import llava_modality_grouped
from dflop_ds.schedule.splitters.verl import verl_karmarkar_karp, verl_workload

Buckets = list[list[int]]
__all__ = [
    "dflop_ilp",
    "llava_modality_grouped",
    "ortools_available",
    "scalar_lpt",
    "stock_sequential",
    "timed",
    "verl_karmarkar_karp",
    "verl_workload",
]


def stock_sequential(n: int, n_buckets: int, seed: int = 0) -> Buckets:
    """Stock DeepSpeed / HF Trainer: shuffle, then the registered ``"stock"`` splitter's
    consecutive chunks of a fixed sample count (one rank of ``n_buckets`` microbatches)."""
    order = np.random.default_rng(seed).permutation(n)
    return make_splitter("stock").split(SplitRequest(order.tolist(), np.zeros(n), n_buckets, 1)).ranks[0]


def scalar_lpt(scalar_costs: np.ndarray, n_buckets: int) -> Buckets:
    """Greedy LPT on one scalar cost (VeOmni-style post-balancing): largest first, each to the
    bucket with the smallest total."""
    values = np.asarray(scalar_costs, dtype=float)
    heap = [(0.0, bucket) for bucket in range(n_buckets)]
    buckets: Buckets = [[] for _ in range(n_buckets)]
    for item in np.argsort(-values, kind="stable").tolist():
        total, bucket = heapq.heappop(heap)
        buckets[bucket].append(int(item))
        heapq.heappush(heap, (total + float(values[item]), bucket))
    return buckets


def ortools_available() -> bool:
    """Whether OR-Tools' CP-SAT can be imported (an optional, benchmark-only dependency)."""
    try:
        from ortools.sat.python import cp_model  # noqa: F401
    except ImportError:
        return False
    return True


def dflop_ilp(
    costs: np.ndarray, n_buckets: int, time_limit_s: float = 10.0, backend: str | None = None, scale: float = 1e6
) -> Buckets | None:
    """DFLOP's scheduler as published: binary ``x[i, j]``, minimise ``C`` with ``C >=`` each
    bucket's summed cost per column, each item in one bucket; no warm start, no symmetry
    breaking, a time limit. CP-SAT (one worker; costs scaled to integers by ``scale`` over the
    largest cost) when OR-Tools is installed, else the same model through PuLP/CBC.
    Returns ``None`` when no split was found within the limit."""
    matrix = np.asarray(costs, dtype=float)
    matrix = matrix[:, None] if matrix.ndim == 1 else matrix
    backend = backend or ("cpsat" if ortools_available() else "cbc")
    if backend == "cpsat":
        return _dflop_cpsat(matrix, n_buckets, time_limit_s, scale)
    return _dflop_pulp(matrix, n_buckets, time_limit_s)


def _dflop_cpsat(costs: np.ndarray, n_buckets: int, time_limit_s: float, scale: float) -> Buckets | None:
    from ortools.sat.python import cp_model

    n, k = costs.shape
    ints = np.rint(costs / max(costs.max(), 1e-300) * scale).astype(np.int64)
    model = cp_model.CpModel()
    x = [[model.NewBoolVar(f"x{i}_{j}") for j in range(n_buckets)] for i in range(n)]
    makespan = model.NewIntVar(0, int(ints.sum(axis=0).max()), "C")
    for i in range(n):
        model.AddExactlyOne(x[i])
    for j in range(n_buckets):
        for c in range(k):
            model.Add(sum(int(ints[i, c]) * x[i][j] for i in range(n) if ints[i, c]) <= makespan)
    model.Minimize(makespan)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit_s)
    solver.parameters.num_workers = 1
    status = solver.Solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    return [[i for i in range(n) if solver.BooleanValue(x[i][j])] for j in range(n_buckets)]


def _dflop_pulp(costs: np.ndarray, n_buckets: int, time_limit_s: float) -> Buckets | None:
    import warnings

    import pulp

    warnings.simplefilter("ignore", DeprecationWarning)  # PuLP 3.x deprecates its 2.x API

    n, k = costs.shape
    problem = pulp.LpProblem("dflop", pulp.LpMinimize)
    x = pulp.LpVariable.dicts("x", (range(n), range(n_buckets)), cat=pulp.LpBinary)
    makespan = pulp.LpVariable("C", lowBound=0)
    problem += makespan
    for i in range(n):
        problem += pulp.lpSum(x[i][j] for j in range(n_buckets)) == 1
    for j in range(n_buckets):
        for c in range(k):
            problem += pulp.lpSum(float(costs[i, c]) * x[i][j] for i in range(n)) <= makespan
    problem.solve(pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, threads=1))
    if problem.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return None
    return [[i for i in range(n) if (x[i][j].value() or 0) > 0.5] for j in range(n_buckets)]


def timed(function, *args, **kwargs) -> tuple[object, float]:
    """``(result, seconds)`` of one call."""
    started = time.perf_counter()
    result = function(*args, **kwargs)
    return result, time.perf_counter() - started
