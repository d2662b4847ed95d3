"""Re-implementations of the microbatch splits users would pick instead of DFLOP's.

Each baseline maps a global batch of ``n`` items to ``n_buckets`` buckets and returns
``list[list[int]]`` (item indices per bucket), the format of ``Partition.buckets``. They are
written from the published descriptions of each system (see docs in each function); none is
tuned beyond what the original does.
"""

from __future__ import annotations

import heapq
import time
from typing import Optional, Sequence

import numpy as np

from dflop_ds.schedule.lpt import differencing_assign, labels_to_buckets

Buckets = list[list[int]]


def stock_sequential(n: int, n_buckets: int, seed: int = 0) -> Buckets:
    """Stock DeepSpeed / HF Trainer: shuffle, then consecutive chunks of a fixed sample count
    (``n / n_buckets``; sizes differ by at most one when it does not divide)."""
    order = np.random.default_rng(seed).permutation(n)
    return [chunk.tolist() for chunk in np.array_split(order, n_buckets)]


def _even_chunks(indices: Sequence[int], lengths: np.ndarray, n_chunks: int) -> Buckets:
    """LLaVA's chunking of one length-sorted megabatch: each index goes to the chunk with the
    smallest summed length that is not yet full; a megabatch that does not divide evenly is
    dealt round-robin instead."""
    if len(indices) % n_chunks:
        return [list(indices[i::n_chunks]) for i in range(n_chunks)]
    per_chunk = len(indices) // n_chunks
    chunks: Buckets = [[] for _ in range(n_chunks)]
    sums = [0.0] * n_chunks
    for index in indices:
        target = sums.index(min(sums))
        chunks[target].append(int(index))
        sums[target] += float(lengths[index])
        if len(chunks[target]) == per_chunk:
            sums[target] = float("inf")
    return chunks


def _length_grouped(indices: np.ndarray, lengths: np.ndarray, megabatch: int, n_chunks: int,
                    rng: np.random.Generator) -> list[int]:
    """Shuffle, cut into megabatches, sort each by decreasing length, chunk evenly, flatten."""
    shuffled = indices[rng.permutation(indices.size)]
    flat: list[int] = []
    for start in range(0, shuffled.size, megabatch):
        group = sorted(shuffled[start:start + megabatch].tolist(), key=lambda i: -lengths[i])
        for chunk in _even_chunks(group, lengths, n_chunks):
            flat.extend(chunk)
    return flat


def llava_modality_grouped(lengths: np.ndarray, is_multimodal: np.ndarray, n_buckets: int,
                           world_size: int = 8, seed: int = 0) -> Buckets:
    """LLaVA's ``group_by_modality_length`` sampler applied to one global batch.

    Image/video samples and text-only samples are grouped separately: each modality is
    shuffled and cut into megabatches of ``world_size * per_bucket`` samples, each megabatch is
    sorted by length and dealt greedily to the ``world_size`` chunk with the smallest summed
    length. Full megabatches of both modalities are shuffled together; the two incomplete
    leftovers are concatenated, in index order, at the end. The resulting sample order is then
    cut into consecutive buckets of ``n / n_buckets`` samples, as the trainer's data loader does.
    ``lengths`` are what LLaVA measures: the text length (it does not count image tokens).
    """
    lengths = np.asarray(lengths, dtype=float)
    n = lengths.size
    per_bucket = max(n // n_buckets, 1)
    chunks = min(world_size, n_buckets)
    megabatch = chunks * per_bucket
    rng = np.random.default_rng(seed)
    mm = np.flatnonzero(np.asarray(is_multimodal, dtype=bool))
    text = np.flatnonzero(~np.asarray(is_multimodal, dtype=bool))
    full: list[list[int]] = []
    leftover: list[int] = []
    for group in (mm, text):
        order = _length_grouped(group, lengths, megabatch, chunks, rng)
        cut = len(order) - len(order) % megabatch
        full.extend(order[i:i + megabatch] for i in range(0, cut, megabatch))
        leftover.extend(order[cut:])
    flat = [i for k in rng.permutation(len(full)) for i in full[k]] + sorted(leftover)
    return [chunk.tolist() for chunk in np.array_split(np.array(flat, dtype=np.int64), n_buckets)]


def verl_workload(seqlens: np.ndarray) -> np.ndarray:
    """verl's per-sequence workload estimate: ``24576 * s + s**2`` (linear plus attention)."""
    s = np.asarray(seqlens, dtype=float)
    return 24576.0 * s + s * s


def verl_karmarkar_karp(seqlens: np.ndarray, n_buckets: int, equal_size: bool = True) -> Buckets:
    """verl's ``get_seqlen_balanced_partitions``: Karmarkar-Karp largest differencing on the
    workload of each sequence, with verl's equal-size start (``n_buckets`` sorted items at a
    time, one per partition). On one scalar column our vector differencing is exactly that
    algorithm, so it is reused; only the input (verl's workload, LLM length only) differs."""
    workload = verl_workload(seqlens)[:, None]
    return labels_to_buckets(differencing_assign(workload, n_buckets, equal_size=equal_size), n_buckets)


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


def dflop_ilp(costs: np.ndarray, n_buckets: int, time_limit_s: float = 10.0,
              backend: Optional[str] = None, scale: float = 1e6) -> Optional[Buckets]:
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


def _dflop_cpsat(costs: np.ndarray, n_buckets: int, time_limit_s: float, scale: float) -> Optional[Buckets]:
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


def _dflop_pulp(costs: np.ndarray, n_buckets: int, time_limit_s: float) -> Optional[Buckets]:
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
