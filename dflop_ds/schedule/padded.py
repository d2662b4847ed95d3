"""Padding-aware starting splits: when a microbatch is padded to its longest sample.

Under padding, a microbatch's LLM cost is about ``count * llm_cost(longest)``, so mixing a
long sample with short ones wastes the short ones' padding. Both starts below order samples by
decreasing length so that each microbatch's first sample is its longest; the encoder column
adds up (tiles are batched, not padded). Pure functions of arrays, returning bucket lists.
"""

from __future__ import annotations

import heapq

import numpy as np

from dflop_ds.schedule.lpt import labels_to_buckets

Buckets = list[list[int]]


def length_order(costs: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Items by decreasing length, ties by decreasing total cost (deterministic)."""
    return np.lexsort((np.arange(len(lengths)), -costs.sum(axis=1), -np.asarray(lengths, dtype=float)))


def padded_lpt(costs: np.ndarray, lengths: np.ndarray, n_buckets: int) -> Buckets:
    """Padding-aware vector LPT.

    Items go longest first, so a bucket's first item is its longest and each later item costs
    that item's LLM cost again. An item opens a new bucket when that is no worse than joining
    the best used bucket, else joins it (ties: the lowest bucket); the last items fill the
    still-empty buckets. Items within a bucket are in that order.

    The greedy rule is followed exactly, in three phases that each skip most of its work: the
    leading run of items that must open a bucket is found at once (:func:`_leading_opens`); the
    items between that and the last bucket's opening scan the used buckets as the rule says; once
    every bucket is used, the best bucket is read off a heap of the buckets' padded LLM times
    when its encoder time is not the larger (else all buckets are scanned).
    """
    n = costs.shape[0]
    if n < n_buckets:
        raise ValueError(f"{n} items cannot fill {n_buckets} non-empty buckets")
    bad = np.flatnonzero(~np.isfinite(costs).all(axis=1))
    if bad.size:
        raise ValueError(f"item {int(bad[0])} has a non-finite cost {costs[bad[0]].tolist()}")
    order = length_order(costs, lengths)
    enc_cost = costs[order, 0] if costs.shape[1] > 1 else np.zeros(n)
    llm_cost = costs[order, 1] if costs.shape[1] > 1 else costs[order, 0]
    labels = np.empty(n, dtype=np.int64)  # bucket of each item, by position in ``order``
    used = _leading_opens(enc_cost, llm_cost, n_buckets)
    labels[:used] = np.arange(used)
    if used < n:
        _place_the_rest(labels, used, enc_cost, llm_cost, n_buckets)
    return labels_to_buckets(labels, n_buckets, order)


def _place_the_rest(labels: np.ndarray, used: int, enc_cost: np.ndarray, llm_cost: np.ndarray, n_buckets: int) -> None:
    """:func:`padded_lpt`'s buckets (in ``labels``, in place) of the items after the first ``used``,
    which opened buckets ``0..used-1``; costs by position in length order."""
    n = labels.size
    state = _PaddedBuckets(n_buckets, enc_cost[:used], llm_cost[:used])
    encs, llms = enc_cost.tolist(), llm_cost.tolist()
    position = used
    while position < n and used < n_buckets:
        if n - position <= n_buckets - used:  # the rest must open the still-empty buckets
            labels[position:] = np.arange(used, used + n - position)
            return
        c_enc, c_llm = encs[position], llms[position]
        grown = np.maximum(state.enc[:used] + c_enc, state.end[:used])
        b = int(grown.argmin())
        if max(c_enc, c_llm) <= grown[b]:
            b = used
            state.open(b, c_llm)
            used += 1
        state.join(b, c_enc)
        labels[position] = b
        position += 1
    heap = [(end, b) for b, end in enumerate(state.ends)]
    heapq.heapify(heap)
    for later in range(position, n):
        c_enc = encs[later]
        end, top = heap[0]
        while end != state.ends[top]:  # an entry left behind by a join found by scanning
            heapq.heappop(heap)
            end, top = heap[0]
        # ``top`` has the smallest padded LLM time (lowest index among equals): it is the best
        # bucket when its encoder time is not the larger, as no bucket grows below that time
        b = top if state.encs[top] + c_enc <= end else int(np.maximum(state.enc + c_enc, state.end).argmin())
        state.join(b, c_enc)
        if b == top:
            heapq.heapreplace(heap, (state.ends[b], b))
        else:
            heapq.heappush(heap, (state.ends[b], b))
        labels[later] = b


def _leading_opens(enc_cost: np.ndarray, llm_cost: np.ndarray, n_buckets: int) -> int:
    """How many items (in length order) open a bucket each before any item joins one.

    Every item does when there are as many buckets as items. Else, with costs that are not
    negative, item ``t`` opens when its LLM cost is at most every open bucket's padded LLM time
    after one more item (twice its first item's): joining costs at least that, and at least the
    item's encoder cost. The first item that fails this test is left to the exact rule."""
    n = llm_cost.size
    if n <= n_buckets:
        return n
    if n == 0 or (enc_cost < 0).any() or (llm_cost < 0).any():
        return min(n, 1)
    lowest_end = np.minimum.accumulate(llm_cost[: n_buckets - 1] + llm_cost[: n_buckets - 1])
    joins = np.flatnonzero(llm_cost[1:n_buckets] > lowest_end)
    return int(joins[0]) + 1 if joins.size else n_buckets


class _PaddedBuckets:
    """Bucket state of :func:`padded_lpt`: encoder time, LLM cost of the first item (``unit``),
    padded LLM time, and that time after one more item (``end``); Python lists for reading one
    bucket, arrays ``enc`` and ``end`` kept in step for scanning all."""

    def __init__(self, n_buckets: int, first_enc: np.ndarray, first_llm: np.ndarray) -> None:
        used = first_enc.size
        self.enc, self.end = np.zeros(n_buckets), np.zeros(n_buckets)
        self.enc[:used] = 0.0 + first_enc
        llm = 0.0 + first_llm
        self.end[:used] = llm + first_llm
        self.encs, self.ends = self.enc.tolist(), self.end.tolist()
        self.units = [*first_llm.tolist(), *[0.0] * (n_buckets - used)]
        self.llms = [*llm.tolist(), *[0.0] * (n_buckets - used)]

    def open(self, b: int, c_llm: float) -> None:
        """Bucket ``b`` gets its first item, of LLM cost ``c_llm`` (then :meth:`join` it)."""
        self.units[b] = c_llm

    def join(self, b: int, c_enc: float) -> None:
        """Add an item of encoder cost ``c_enc`` to bucket ``b``."""
        self.llms[b] += self.units[b]
        self.ends[b] = self.end[b] = self.llms[b] + self.units[b]
        self.encs[b] += c_enc
        self.enc[b] = self.encs[b]


def _groups_within(enc: list[float], llm: list[float], limit: float) -> list[int]:
    """Start positions of the fewest contiguous groups (in length order) whose padded LLM cost
    (count x the first item's) and summed encoder cost both stay within ``limit``."""
    starts = [0]
    first_llm, enc_sum, count = llm[0], 0.0, 0
    for pos in range(len(enc)):
        if count and ((count + 1) * first_llm > limit or enc_sum + enc[pos] > limit):
            starts.append(pos)
            first_llm, enc_sum, count = llm[pos], 0.0, 0
        enc_sum += enc[pos]
        count += 1
    return starts


def padded_contiguous(costs: np.ndarray, lengths: np.ndarray, n_buckets: int, iterations: int = 40) -> Buckets:
    """The best split into ``n_buckets`` runs of consecutive items in length order.

    Binary search on the makespan: for a candidate limit, greedy grouping gives the fewest
    contiguous groups that fit it, which is optimal among contiguous splits under the padded
    cost model. Groups left over (when fewer than ``n_buckets`` are needed) come from splitting
    the largest groups, which never raises the makespan.
    """
    n = costs.shape[0]
    if n < n_buckets:
        raise ValueError(f"{n} items cannot fill {n_buckets} non-empty buckets")
    order = length_order(costs, lengths)
    enc = (costs[order, 0] if costs.shape[1] > 1 else np.zeros(n)).tolist()
    llm = costs[order, -1].tolist()
    low = max(max(llm), max(enc))
    high = max(n * llm[0], sum(enc), low)
    starts = _groups_within(enc, llm, high)
    for _ in range(iterations):
        if high - low <= 1e-9 * high:
            break
        middle = (low + high) / 2
        attempt = _groups_within(enc, llm, middle)
        if len(attempt) <= n_buckets:
            high, starts = middle, attempt
        else:
            low = middle
    groups = [order[a:b].tolist() for a, b in zip(starts, starts[1:] + [n])]
    while len(groups) < n_buckets:
        size, widest = max((len(g), i) for i, g in enumerate(groups))
        group = groups.pop(widest)
        groups[widest:widest] = [group[: size // 2], group[size // 2 :]]
    return groups
