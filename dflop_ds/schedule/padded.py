"""Padding-aware starting splits: when a microbatch is padded to its longest sample.

Under padding, a microbatch's LLM cost is about ``count * llm_cost(longest)``, so mixing a
long sample with short ones wastes the short ones' padding. Both starts below order samples by
decreasing length so that each microbatch's first sample is its longest; the encoder column
adds up (tiles are batched, not padded). Pure functions of arrays, returning bucket lists.
"""

from __future__ import annotations

import numpy as np

Buckets = list[list[int]]


def length_order(costs: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Items by decreasing length, ties by decreasing total cost (deterministic)."""
    return np.lexsort((np.arange(len(lengths)), -costs.sum(axis=1), -np.asarray(lengths, dtype=float)))


def padded_lpt(costs: np.ndarray, lengths: np.ndarray, n_buckets: int) -> Buckets:
    """Padding-aware vector LPT.

    Items go longest first, so a bucket's first item is its longest and each later item costs
    that item's LLM cost again. An item opens a new bucket when that is no worse than joining
    the best used bucket, else joins it; the last items fill the still-empty buckets.
    """
    n = costs.shape[0]
    if n < n_buckets:
        raise ValueError(f"{n} items cannot fill {n_buckets} non-empty buckets")
    enc = np.zeros(n_buckets)
    llm = np.zeros(n_buckets)
    unit = np.zeros(n_buckets)
    buckets: Buckets = [[] for _ in range(n_buckets)]
    used = 0  # buckets 0..used-1 hold items, the others are empty
    rows = costs[:, :2].tolist() if costs.shape[1] > 1 else [[0.0, c] for c in costs[:, 0].tolist()]
    for position, item in enumerate(length_order(costs, lengths).tolist()):
        c_enc, c_llm = rows[item]
        must_open = n - position <= n_buckets - used
        b = used
        if used and not must_open:
            grown = np.maximum(enc[:used] + c_enc, llm[:used] + unit[:used])
            best = int(grown.argmin())
            if used == n_buckets or max(c_enc, c_llm) > grown[best]:
                b = best
        if b == used:
            unit[b] = c_llm
            used += 1
        llm[b] += unit[b]
        enc[b] += c_enc
        buckets[b].append(item)
    return buckets


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
