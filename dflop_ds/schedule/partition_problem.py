"""What the partitioner is asked: one batch of items to split into buckets, checked once.

:class:`PartitionProblem` holds the items' costs, the bucket count, the memory cap, the true
microbatch cost and memory when the caller has them, and the exact solver's limits. It scores a
split (:meth:`PartitionProblem.score`) and checks it against the cap (:meth:`PartitionProblem.fits`),
the one measure every candidate generator (:mod:`dflop_ds.schedule.candidates`) is judged by.
"""

from __future__ import annotations

import math
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
    labels_to_buckets,
    true_times,
)

#: A bucket's true memory (e.g. padded to its longest item), given its item indices.
MicrobatchMemory = Callable[[list[int]], float]


@dataclass(frozen=True, eq=False)
class Candidate:
    """A proposed split: ``labels[item] = bucket``, and the method that proposed it."""

    labels: np.ndarray
    solver: str


@dataclass(frozen=True, eq=False)
class PartitionProblem:
    """One batch to split into ``n_buckets`` non-empty buckets, validated.

    Attributes:
        costs: ``(n, k)`` per-item costs.
        n_buckets: number of buckets, ``1 <= n_buckets <= n``.
        memory: per-item memory and the per-bucket cap (None: no cap); checked: finite,
            non-negative, one entry per item, every item under the cap unless ``allow_oversize``.
        allow_oversize: an item whose memory alone exceeds the cap gets a bucket of its own
            (the other items are split over the remaining buckets under the cap).
        microbatch_cost: a bucket's true ``(k,)`` cost from its item indices (None: summed costs).
        lengths: ``(n,)`` padded dimension of each item, enabling the padding-aware starts.
        microbatch_memory: a bucket's true memory, checked against the cap on the chosen split.
        time_limit_s: time the exact solver may take (0: never looks at the clock).
        node_limit: branch-and-bound nodes the exact solver may explore (0: none).
        seed: orders equal items and seeds the exact solver.
        bound: a lower bound on the additive makespan of any split (computed).
        deadline: ``time.perf_counter()`` value by which a timed exact solve should end
            (computed when the problem is built; ``inf`` without a time limit).
    """

    costs: np.ndarray
    n_buckets: int
    memory: MemoryCap | None = None
    allow_oversize: bool = False
    microbatch_cost: MicrobatchCost | None = None
    lengths: np.ndarray | None = None
    microbatch_memory: MicrobatchMemory | None = None
    time_limit_s: float = 0.0
    node_limit: int = 0
    seed: int = 0
    bound: float = field(init=False)
    deadline: float = field(init=False)

    def __post_init__(self) -> None:
        matrix = as_cost_matrix(self.costs)
        n = matrix.shape[0]
        object.__setattr__(self, "costs", matrix)
        object.__setattr__(self, "n_buckets", bucket_count(self.n_buckets, n))
        check_limits(self.time_limit_s, self.node_limit)
        if self.memory is not None:
            object.__setattr__(self, "memory", checked_cap(self.memory, n, self.n_buckets, self.allow_oversize))
        if self.lengths is not None:
            lengths = np.asarray(self.lengths, dtype=float)
            if lengths.shape != (n,):
                raise ValueError(f"lengths must have one entry per item ({n}), got shape {lengths.shape}")
            object.__setattr__(self, "lengths", lengths)
        object.__setattr__(self, "bound", lower_bound(matrix, self.n_buckets))
        timed = self.time_limit_s > 0
        object.__setattr__(self, "deadline", time.perf_counter() + self.time_limit_s if timed else math.inf)

    def additive(self, labels: np.ndarray) -> float:
        """The makespan of ``labels`` with every bucket costing the sum of its items."""
        return float(bucket_loads(self.costs, labels, self.n_buckets).max())

    def score(self, labels: np.ndarray) -> float:
        """The makespan of ``labels``: by ``microbatch_cost`` when given, else additive."""
        if self.microbatch_cost is None:
            return self.additive(labels)
        buckets = labels_to_buckets(labels, self.n_buckets)
        return float(true_times(buckets, self.microbatch_cost, self.costs.shape[1]).max())

    def fits(self, labels: np.ndarray) -> bool:
        """Whether every bucket of ``labels`` keeps its summed item memory under the cap."""
        return fits(labels, self.n_buckets, self.memory)


def fits(labels: np.ndarray, n_buckets: int, memory: MemoryCap | None) -> bool:
    """Whether a labelling respects the memory cap (always true without one)."""
    if memory is None:
        return True
    return bool(np.bincount(labels, weights=memory.memory, minlength=n_buckets).max() <= memory.cap)


def bucket_count(n_buckets: float, n: int) -> int:
    """``n_buckets`` as an int, checked to be positive and at most the ``n`` items."""
    if int(n_buckets) != n_buckets or n_buckets < 1:
        raise ValueError(f"n_buckets must be a positive integer, got {n_buckets}")
    if n < n_buckets:
        raise ValueError(f"cannot fill {n_buckets} buckets with {n} items: no bucket may be empty")
    return int(n_buckets)


def check_limits(time_limit_s: float, node_limit: int) -> None:
    """Raise unless the exact solver's limits are a non-negative time and node count."""
    if time_limit_s < 0:
        raise ValueError(f"time_limit_s must be >= 0, got {time_limit_s}")
    if int(node_limit) != node_limit or node_limit < 0:
        raise ValueError(f"node_limit must be a non-negative integer, got {node_limit}")


def checked_cap(memory: MemoryCap, n: int, n_buckets: int, allow_oversize: bool = False) -> MemoryCap:
    """``memory`` with its per-item usage as a float vector, checked: one finite, non-negative
    entry per item, every item under the cap (unless ``allow_oversize``) and, when every item is,
    the total within ``n_buckets`` caps. Raises naming the first item at fault."""
    usage = np.asarray(memory.memory, dtype=float).reshape(-1)
    if usage.shape != (n,):
        raise ValueError(f"memory must have one entry per item ({n}), got shape {np.shape(memory.memory)}")
    limit = float(memory.cap)
    bad = np.flatnonzero(~np.isfinite(usage) | (usage < 0))
    if bad.size:
        raise ValueError(f"item {int(bad[0])} has invalid memory {usage[bad[0]]}")
    too_big = np.flatnonzero(usage > limit)
    if too_big.size and not allow_oversize:
        i = int(too_big[0])
        raise ValueError(f"item {i} needs memory {usage[i]:g} > memory_cap {limit:g}: it fits in no bucket")
    if not too_big.size and usage.sum() > n_buckets * limit:
        raise InfeasibleError(
            f"items need {usage.sum():g} memory in total, more than {n_buckets} buckets x memory_cap {limit:g}"
        )
    return MemoryCap(usage, limit)


def buckets_to_labels(buckets: list[list[int]], n: int) -> np.ndarray:
    """Bucket lists -> ``labels[item] = bucket``."""
    labels = np.empty(n, dtype=np.int64)
    for b, items in enumerate(buckets):
        labels[items] = b
    return labels
