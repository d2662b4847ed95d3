"""The exact half of the partitioner: DFLOP's min-makespan ILP through PuLP, warm-started.

Binary ``x[i, j]`` puts item ``i`` in bucket ``j``; minimise ``C`` subject to ``C >= sum_i
cost[i, c] * x[i, j]`` for every bucket ``j`` and column ``c``, each item in exactly one bucket,
no bucket empty, and the memory cap. Two additions over the published model make a time-limited
solve useful: bucket symmetry is broken (the item of rank ``r`` in a fixed order may only use
buckets ``0..r``), and ``C`` is boxed between a valid lower bound and the heuristic's makespan,
whose split is given to the solver as its starting incumbent.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import pulp

from dflop_ds.schedule.lpt import MemoryCap


@dataclass(frozen=True)
class IlpResult:
    """What the solver returned: ``labels`` (``None`` when it found no split) and its status."""

    labels: np.ndarray | None
    optimal: bool
    infeasible: bool
    solver: str


def available_solver() -> str:
    """``"highs"`` when PuLP can reach HiGHS (its command line or its Python API), else
    ``"cbc"`` (bundled with PuLP)."""
    names = pulp.listSolvers(onlyAvailable=True)
    return "highs" if "HiGHS_CMD" in names or "HiGHS" in names else "cbc"


def _solver(name: str, time_limit_s: float, seed: int, warm: bool, node_limit: int = 0) -> pulp.LpSolver:
    """A single-threaded, seeded solver, warm-started where PuLP supports it, limited by time
    (``time_limit_s > 0``) and/or by branch-and-bound nodes (``node_limit > 0``). With a node
    limit alone nothing looks at the clock: the same input gets the same answer."""
    limit = max(float(time_limit_s), 0.01) if time_limit_s > 0 else None
    nodes = int(node_limit) if node_limit > 0 else None
    if name == "highs":
        if "HiGHS_CMD" in pulp.listSolvers(onlyAvailable=True):
            return pulp.HiGHS_CMD(
                msg=False,
                timeLimit=limit,
                warmStart=warm,
                threads=1,
                options=[f"mip_max_nodes={nodes}"] if nodes else None,
            )
        extra = {"mip_max_nodes": nodes} if nodes else {}
        return pulp.HiGHS(msg=False, timeLimit=limit, threads=1, random_seed=seed, **extra)
    return pulp.PULP_CBC_CMD(
        msg=False,
        timeLimit=limit,
        warmStart=warm,
        threads=1,
        gapRel=1e-7,
        maxNodes=nodes,
        options=[f"randomSeed {seed + 1}", f"randomCbcSeed {seed + 1}"],
    )


def canonical_labels(labels: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Relabel buckets by the rank (in ``order``) of their first item, so item of rank ``r``
    sits in a bucket ``<= r``: the form the symmetry-broken model accepts."""
    mapping: dict[int, int] = {}
    for item in order.tolist():
        mapping.setdefault(int(labels[item]), len(mapping))
    return np.array([mapping[int(label)] for label in labels.tolist()], dtype=np.int64)


def solve_ilp(
    costs: np.ndarray,
    n_buckets: int,
    order: np.ndarray,
    *,
    lower: float,
    upper: float | None,
    warm_labels: np.ndarray | None,
    time_limit_s: float,
    seed: int = 0,
    memory: MemoryCap | None = None,
    node_limit: int = 0,
) -> IlpResult:
    """Solve the min-makespan model within ``time_limit_s`` seconds (0: no time limit) and
    ``node_limit`` branch-and-bound nodes (0: no node limit); give at least one.

    ``order`` ranks items for symmetry breaking (any permutation is valid; largest first works
    best); ``lower``/``upper`` box the makespan variable (``upper`` must be achievable, e.g. the
    warm start's makespan); ``warm_labels`` seeds the incumbent.
    """
    if time_limit_s <= 0 and node_limit <= 0:
        raise ValueError("solve_ilp needs a time limit or a node limit")
    with warnings.catch_warnings():  # PuLP 3.x deprecates the 2.x API we keep for compatibility
        warnings.simplefilter("ignore", DeprecationWarning)
        return _solve(costs, n_buckets, order, lower, upper, warm_labels, time_limit_s, seed, memory, node_limit)


def _solve(costs, n_buckets, order, lower, upper, warm_labels, time_limit_s, seed, memory, node_limit) -> IlpResult:
    """Build and solve the model (see :func:`solve_ilp`)."""
    n, k = costs.shape
    name = available_solver()
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n)
    problem = pulp.LpProblem("min_makespan", pulp.LpMinimize)
    makespan = pulp.LpVariable("C", lowBound=float(lower), upBound=None if upper is None else float(upper))
    x = {
        (i, j): pulp.LpVariable(f"x_{i}_{j}", cat=pulp.LpBinary)
        for i in range(n)
        for j in range(min(n_buckets, int(rank[i]) + 1))
    }
    problem += makespan
    per_bucket: list[list[int]] = [[] for _ in range(n_buckets)]
    for i, j in x:
        per_bucket[j].append(i)
    for i in range(n):
        problem += pulp.lpSum(x[i, j] for j in range(min(n_buckets, int(rank[i]) + 1))) == 1, f"once_{i}"
    for j, items in enumerate(per_bucket):
        problem += pulp.lpSum(x[i, j] for i in items) >= 1, f"nonempty_{j}"
        for c in range(k):
            problem += (
                pulp.lpSum(float(costs[i, c]) * x[i, j] for i in items if costs[i, c] > 0) <= makespan,
                f"load_{j}_{c}",
            )
        if memory is not None:
            problem += pulp.lpSum(float(memory.memory[i]) * x[i, j] for i in items) <= float(memory.cap), f"mem_{j}"
    warm = warm_labels is not None
    if warm:
        start = canonical_labels(warm_labels, order)
        for (i, j), var in x.items():
            var.setInitialValue(1 if start[i] == j else 0)
        makespan.setInitialValue(float(bucket_max(costs, start, n_buckets)))
    problem.solve(_solver(name, time_limit_s, seed, warm, node_limit))
    if problem.status == pulp.LpStatusInfeasible:
        return IlpResult(None, False, True, name)
    if problem.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return IlpResult(None, False, False, name)
    labels = np.full(n, -1, dtype=np.int64)
    for (i, j), var in x.items():
        if var.value() is not None and var.value() > 0.5:
            labels[i] = j
    if (labels < 0).any():
        return IlpResult(None, False, False, name)
    return IlpResult(labels, problem.sol_status == pulp.LpSolutionOptimal, False, name)


def bucket_max(costs: np.ndarray, labels: np.ndarray, n_buckets: int) -> float:
    """Makespan of a labelling: the largest per-bucket column sum."""
    loads = np.zeros((n_buckets, costs.shape[1]))
    np.add.at(loads, labels, costs)
    return float(loads.max())
