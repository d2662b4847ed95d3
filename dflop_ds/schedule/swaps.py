"""The swap search of :func:`~dflop_ds.schedule.lpt.improve`: the value of swapping an item of the
slowest bucket with one of another bucket, the best such swap (with a sound lower-bound filter for
large sets), and the bookkeeping that keeps each round cheap (buckets ordered by time, their items
as arrays). Pure functions of arrays, apart from the two state holders ``improve`` updates."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

_INF = np.inf
#: Swap pairs times cost columns from which :func:`improve` filters the other items by a lower
#: bound on their swaps before scoring pairs (:func:`best_swap`; below it the filter's own array
#: operations cost more than it saves), and how many of the lowest it scores first.
SWAP_FILTER_WORK = 49_152
SWAP_FILTER_PROBES = 8


@dataclass(frozen=True)
class MemoryCap:
    """Per-item memory and the per-bucket cap it must respect (the partitioner's form of a
    splitter's :class:`~dflop_ds.schedule.splitters.MemoryBudget`; a run's cap and where it came
    from: :class:`~dflop_ds.train.memory_cap.RunMemoryCap`)."""

    memory: np.ndarray
    cap: float


def swap_values(costs, loads, labels, b, inside, outside, used, memory, work: list | None = None) -> np.ndarray:
    """``(p, q)``: the larger new time of bucket ``b`` and of the other item's bucket when item
    ``inside[a]`` swaps with ``outside[z]`` (``inf`` where the memory cap forbids it).

    ``work``: a one-array list whose array is reused (and grown) for the matrices, so that a
    search of many rounds does not allocate and free them every round (large ones make the
    allocator hand memory back and fault it in again); the answer is then a view of it, valid
    until the next call with the same ``work``."""
    p, q = inside.size, outside.size
    if work is None:
        work = [np.empty(0)]
    if work[0].size < 3 * p * q:
        work[0] = np.empty(3 * p * q)
    value, delta, column = (work[0][i * p * q : (i + 1) * p * q].reshape(p, q) for i in range(3))
    other_loads = loads[labels[outside]]
    for c in range(costs.shape[1]):
        into = value if c == 0 else column
        np.subtract(costs[outside, c][None, :], costs[inside, c][:, None], out=delta)
        np.add(delta, loads[b, c], out=into)  # bucket b's new load
        np.subtract(other_loads[:, c][None, :], delta, out=delta)  # the other bucket's
        np.maximum(into, delta, out=into)
        if c:
            np.maximum(value, column, out=value)
    if used is not None:
        shift = memory.memory[outside][None, :] - memory.memory[inside][:, None]
        over = (used[b] + shift > memory.cap) | (used[labels[outside]][None, :] - shift > memory.cap)
        value[over] = _INF
    return value


def best_swap(
    costs: np.ndarray,
    loads: np.ndarray,
    labels: np.ndarray,
    b: int,
    inside: np.ndarray,
    outside: np.ndarray,
    used: np.ndarray | None,
    memory: MemoryCap | None,
    below: float,
    slack: float,
    work: list,
) -> tuple[float, tuple[int, int, int]] | None:
    """The best swap of an item of bucket ``b`` (``inside``, ascending) with one of ``outside``
    (ascending): ``(value, (item, other item, its bucket))`` when its value (the larger new time
    of the two buckets, :func:`swap_values`) is below ``below``, else None. Of equal values the
    lowest item of ``b``, then the lowest other item, as ``argmin`` over every pair picks.

    With many pairs (:data:`SWAP_FILTER_WORK`), the other items are first filtered by
    :func:`swap_floor`, a lower bound on every swap of each one: only those whose bound is within
    ``slack`` (far above the rounding of the bound) of the best value among the few with the
    lowest bounds are scored pair by pair. An item left out has only swaps of a strictly larger
    value than that best, so the pair chosen is the one of the whole set: a sound pruning, not a
    heuristic (the split is the one scoring every pair gives)."""
    if not outside.size:
        return None
    if inside.size * outside.size * costs.shape[1] >= SWAP_FILTER_WORK:
        floor = swap_floor(costs, loads, labels, b, inside, outside)
        probes = min(SWAP_FILTER_PROBES, outside.size)
        lowest = np.argpartition(floor, probes - 1)[:probes]  # any few: ``reach`` bounds the best
        reach = float(swap_values(costs, loads, labels, b, inside, outside[lowest], used, memory, work).min())
        outside = outside[floor <= reach + slack]
    value = swap_values(costs, loads, labels, b, inside, outside, used, memory, work)
    flat = int(value.argmin())
    if not value.flat[flat] < below:
        return None
    other = int(outside[flat % outside.size])
    return float(value.flat[flat]), (int(inside[flat // outside.size]), other, int(labels[other]))


def swap_floor(costs: np.ndarray, loads: np.ndarray, labels: np.ndarray, b: int, inside, outside) -> np.ndarray:
    """``(len(outside),)``: for each item ``z`` of ``outside``, a lower bound (up to rounding) on
    the value of its swap with any item ``a`` of bucket ``b`` (``inside``).

    In a column, the two new loads are ``x = load_b + d`` and ``y = load_q - d`` with
    ``d = cost_z - cost_a``, and ``max(x, y) = (x + y) / 2 + |x - y| / 2 = (load_b + load_q) / 2 +
    |t_z - cost_a|`` with ``t_z = cost_z + (load_b - load_q) / 2``: the nearest item cost of ``b``
    to ``t_z`` (a binary search in its sorted costs) gives the smallest over ``a``. The value is at
    least that in every column, so at least their largest."""
    other_loads = loads[labels[outside]]
    floor = np.zeros(outside.size)
    for c in range(costs.shape[1]):
        own = np.sort(costs[inside, c])
        target = costs[outside, c] + (loads[b, c] - other_loads[:, c]) * 0.5
        at = np.searchsorted(own, target)
        nearest = np.minimum(
            np.abs(own[np.maximum(at - 1, 0)] - target), np.abs(own[np.minimum(at, own.size - 1)] - target)
        )
        np.maximum(floor, (loads[b, c] + other_loads[:, c]) * 0.5 + nearest, out=floor)
    return floor


class ByTime:
    """Buckets in increasing ``(time, number)`` order, kept in step with their times as
    :func:`improve` changes two of them per round: the lightest buckets are then the head of a
    list instead of a partition of every bucket's time each round (most of a round's time with
    thousands of buckets)."""

    def __init__(self, times: np.ndarray) -> None:
        self.entries = sorted(zip(times.tolist(), range(times.size)))

    def update(self, bucket: int, old: float, new: float) -> None:
        """Bucket ``bucket``'s time went from ``old`` to ``new``."""
        del self.entries[bisect.bisect_left(self.entries, (old, bucket))]
        bisect.insort(self.entries, (new, bucket))

    def lightest(self, size: int, exclude: int) -> list[int]:
        """The ``size`` buckets with the smallest times, ``exclude`` left out; of equally timed
        buckets at the boundary the lowest-numbered, so that ranks on any CPU pick the same ones."""
        return [q for _, q in self.entries[:size] if q != exclude]


def items_of(members: list[np.ndarray], buckets: list[int], labels: np.ndarray) -> np.ndarray:
    """The items of ``buckets``, ascending (the order ties between equal swaps are broken in):
    their member arrays joined for a few buckets, the items whose label is one of them for many."""
    if len(buckets) > 32:
        chosen = np.zeros(len(members), dtype=bool)
        chosen[buckets] = True
        return np.flatnonzero(chosen[labels])
    items = np.concatenate([members[q] for q in buckets]) if buckets else np.zeros(0, dtype=np.int64)
    items.sort()
    return items


def exchange(members: list[np.ndarray], b: int, destination: int, item: int, other: int) -> None:
    """Keep ``members`` in step with moving ``item`` from bucket ``b`` to ``destination`` and,
    when ``other >= 0``, ``other`` from ``destination`` to ``b`` (in place)."""
    if other >= 0:
        members[b][members[b] == item] = other
        members[destination][members[destination] == other] = item
    else:
        members[b] = members[b][members[b] != item]
        members[destination] = np.append(members[destination], item)


def bucket_members(labels: np.ndarray, n_buckets: int) -> list[np.ndarray]:
    """The items of each bucket as an array, ascending (:func:`improve` keeps them in step with
    ``labels``: gathering arrays costs a fraction of converting lists of Python integers)."""
    grouped = np.argsort(labels, kind="stable")
    return np.split(grouped, np.cumsum(np.bincount(labels, minlength=n_buckets))[:-1])
