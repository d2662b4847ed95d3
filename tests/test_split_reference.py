"""The vectorised splitting functions give exactly the splits of their plain loops.

Every rank computes these splits independently and the planner predicts from them, so a faster
version must return the same buckets, not just equally good ones. The references below are the
straightforward loops the fast versions replaced, compared on random inputs with many ties.
"""

from __future__ import annotations

import heapq

import numpy as np
import pytest

from dflop_ds.schedule import lpt, swaps
from dflop_ds.schedule.lpt import MemoryCap, differencing_assign, improve, labels_to_buckets
from dflop_ds.schedule.padded import length_order, padded_lpt
from dflop_ds.schedule.splitters import SplitRequest, check_split
from dflop_ds.schedule.splitters.stock import stock_positions


def reference_padded_lpt(costs, lengths, n_buckets):
    """Padding-aware LPT scanning every used bucket for every item."""
    n = costs.shape[0]
    enc, llm, unit = np.zeros(n_buckets), np.zeros(n_buckets), np.zeros(n_buckets)
    buckets = [[] for _ in range(n_buckets)]
    used = 0
    rows = costs[:, :2].tolist() if costs.shape[1] > 1 else [[0.0, c] for c in costs[:, 0].tolist()]
    for position, item in enumerate(length_order(costs, lengths).tolist()):
        c_enc, c_llm = rows[item]
        b = used
        if used and n - position > n_buckets - used:
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


def reference_differencing(costs, n_buckets, equal_size):
    """Vector Karmarkar-Karp differencing keeping every group's items in lists."""
    n, k = costs.shape
    order = np.argsort(costs.max(axis=1), kind="stable")
    if equal_size:
        slots = np.concatenate([np.full(-(-n // n_buckets) * n_buckets - n, -1), order])
        starts = slots.reshape(-1, n_buckets)
    else:
        starts = np.full((n, n_buckets), -1)
        starts[:, 0] = order
    padded = np.vstack([costs, np.zeros((1, k))])

    def entry(sums, groups, tie):
        times = sums.max(axis=1)
        rank = np.argsort(-times, kind="stable")
        return (-(times[rank[0]] - times[rank[-1]]), tie, sums[rank], [groups[r] for r in rank])

    heap = [entry(padded[row], [[int(i)] if i >= 0 else [] for i in row], tie) for tie, row in enumerate(starts)]
    heapq.heapify(heap)
    tie = len(heap)
    while len(heap) > 1:
        _, _, sums_a, groups_a = heapq.heappop(heap)
        _, _, sums_b, groups_b = heapq.heappop(heap)
        merged = [ga + gb for ga, gb in zip(groups_a, groups_b[::-1])]
        heapq.heappush(heap, entry(sums_a + sums_b[::-1], merged, tie))
        tie += 1
    labels = np.empty(n, dtype=np.int64)
    for bucket, group in enumerate(heap[0][3]):
        labels[group] = bucket
    return labels


def reference_improve(costs, labels, n_buckets, memory=None, partners=(12, 48), resplit=8, allow_moves=True):
    """:func:`improve` re-reading every bucket's time and items each round (the same moves,
    swaps and re-splits, from the module's own helpers)."""
    labels = labels.copy()
    loads = lpt.bucket_loads(costs, labels, n_buckets)
    counts = np.bincount(labels, minlength=n_buckets)
    used = np.bincount(labels, weights=memory.memory, minlength=n_buckets) if memory is not None else None
    everyone = np.arange(costs.shape[0])
    state = (costs, labels, loads, counts, used, memory)
    for _ in range(20_000):
        times = loads.max(axis=1)
        b = int(times.argmax())
        if times[b] <= 0.0:
            break
        inside = everyone[labels == b]
        best_value, best_change = times[b] * (1.0 - 1e-12), None
        if allow_moves and counts[b] > 1:
            value = lpt._move_values(loads, b, costs[inside], used, memory, inside)
            flat = int(value.argmin())
            if value.flat[flat] < best_value:
                best_value, best_change = value.flat[flat], (inside[flat // n_buckets], -1, flat % n_buckets)
        by_time = np.argsort(times, kind="stable")  # ties: the lower-numbered bucket, on any CPU
        shrink = max(1.0, inside.size * costs.shape[0] / n_buckets * partners[0] / lpt.SWAP_PAIRS)
        for size in (max(1, int(width / shrink)) if width < n_buckets else width for width in partners):
            pool = np.zeros(n_buckets, dtype=bool)
            pool[by_time[:size]] = True
            pool[b] = False
            outside = everyone[pool[labels]]
            if outside.size:
                value = swaps.swap_values(costs, loads, labels, b, inside, outside, used, memory)
                flat = int(value.argmin())
                if value.flat[flat] < best_value:
                    other = int(outside[flat % outside.size])
                    best_value, best_change = value.flat[flat], (inside[flat // outside.size], other, labels[other])
            if best_change is not None or size >= n_buckets:
                break
        if best_change is None:
            if resplit <= 0 or not lpt._resplit_pair(*state[:5], memory, b, by_time[:resplit]):
                break
            continue
        item, other, destination = (int(v) for v in best_change)
        lpt._relabel(item, destination, *state)
        if other >= 0:
            lpt._relabel(other, b, *state)
    return labels


def random_costs(rng, n, k, kind):
    """Costs with ties (small integers), wide ranges, a heavy encoder column, or padded LLM costs."""
    if kind == "ties":
        return rng.integers(0, 4, (n, k)).astype(float)
    if kind == "wide":
        return rng.exponential(1.0, (n, k)) * 10.0 ** rng.uniform(-3, 3, (n, 1))
    if kind == "encoder-heavy":
        return rng.exponential(1.0, (n, k)) * np.geomspace(100.0, 1.0, k)
    lengths = rng.lognormal(5, 1, n).round() + 1
    return np.stack([rng.integers(0, 8, n) * 20.0, lengths + lengths**2 / 1536], axis=1)[:, :k]


KINDS = ("ties", "wide", "encoder-heavy", "padded")


@pytest.mark.parametrize("kind", KINDS)
def test_padded_lpt_is_the_plain_greedy(kind):
    rng = np.random.default_rng(len(kind))
    for _ in range(150):
        n = int(rng.integers(1, 90))
        n_buckets = int(rng.integers(1, n + 1))
        costs = random_costs(rng, n, int(rng.integers(1, 4)), kind)
        lengths = rng.integers(1, 12, n).astype(float)  # few distinct lengths: many ties in the order
        assert padded_lpt(costs, lengths, n_buckets) == reference_padded_lpt(costs, lengths, n_buckets)


def test_padded_lpt_names_an_item_with_a_non_finite_cost():
    costs = np.ones((5, 2))
    costs[3, 1] = np.nan
    with pytest.raises(ValueError, match="item 3"):
        padded_lpt(costs, np.arange(5.0), 2)


@pytest.mark.parametrize("kind", KINDS)
def test_differencing_is_the_plain_list_version(kind):
    rng = np.random.default_rng(10 + len(kind))
    for _ in range(60):
        n = int(rng.integers(1, 80))
        n_buckets = int(rng.integers(1, n + 1))
        costs = random_costs(rng, n, int(rng.integers(1, 4)), kind)
        for equal_size in (True, False):
            expected = reference_differencing(costs, n_buckets, equal_size)
            np.testing.assert_array_equal(differencing_assign(costs, n_buckets, equal_size), expected)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("filtered", [False, True], ids=["as_shipped", "swap_filter_from_the_first_pair"])
def test_improve_is_the_plain_rescanning_loop(kind, filtered, monkeypatch):
    """The partitioner's local search keeps bucket times and members in step instead of
    rescanning, and (``filtered``) its swap search's lower-bound filter, on from the first pair,
    leaves the answer of scoring every pair: the same labels, with moves, swaps, re-splits and a
    memory cap."""
    if filtered:
        monkeypatch.setattr(swaps, "SWAP_FILTER_WORK", 1)
        monkeypatch.setattr(swaps, "SWAP_FILTER_PROBES", 2)
    rng = np.random.default_rng((30 if filtered else 20) + len(kind))
    for case in range(12 if filtered else 16):
        n_buckets = int(rng.integers(2, 40 if filtered else 70))
        n = n_buckets * int(rng.integers(2, 6 if filtered else 5)) + int(rng.integers(0, n_buckets))
        costs = random_costs(rng, n, int(rng.integers(1, 4)), kind)
        start = rng.permutation(np.arange(n) % n_buckets)  # every bucket used, loads uneven
        memory = None
        if case % 2:
            need = rng.integers(1, 4, n).astype(float)
            memory = MemoryCap(need, float(np.bincount(start, weights=need).max()) + 1.0)
        for options in ({}, {"allow_moves": False, "resplit": 0}, {"partners": (n_buckets,), "resplit": 0}):
            expected = reference_improve(costs, start, n_buckets, memory, **options)
            np.testing.assert_array_equal(improve(costs, start, n_buckets, memory, **options), expected)


def test_the_swap_floor_bounds_every_swap_from_below():
    rng = np.random.default_rng(5)
    for kind in KINDS:
        for k in (1, 2, 3):
            costs = random_costs(rng, 120, k, kind)
            labels = rng.permutation(np.arange(120) % 9)
            loads = lpt.bucket_loads(costs, labels, 9)
            b = int(loads.max(axis=1).argmax())
            inside, outside = np.flatnonzero(labels == b), np.flatnonzero(labels != b)
            values = swaps.swap_values(costs, loads, labels, b, inside, outside, None, None)
            floor = swaps.swap_floor(costs, loads, labels, b, inside, outside)
            assert (values.min(axis=0) >= floor - 1e-12 * costs.sum()).all()
            if k == 1:  # one column: the bound is the best swap of each item
                np.testing.assert_allclose(values.min(axis=0), floor, rtol=1e-12, atol=1e-12 * costs.sum())


def test_labels_to_buckets_keeps_the_items_order():
    rng = np.random.default_rng(3)
    labels = rng.integers(0, 7, 200)
    items = rng.permutation(1000)[:200]
    expected = [[int(items[i]) for i in range(200) if labels[i] == b] for b in range(9)]
    assert labels_to_buckets(labels, 9, items) == expected
    assert labels_to_buckets(labels, 9) == [[i for i in range(200) if labels[i] == b] for b in range(9)]
    with pytest.raises(ValueError, match="bucket labels"):
        labels_to_buckets(labels, 5)


def test_stock_positions_are_numpy_array_splits():
    for n, n_mb, dp in [(10, 3, 2), (64, 4, 4), (7, 2, 3), (100, 7, 5)]:
        expected = [[c.tolist() for c in np.array_split(part, n_mb)] for part in np.array_split(np.arange(n), dp)]
        assert stock_positions(n, n_mb, dp) == expected


def test_result_maps_positions_to_the_batch_and_sums_rows():
    rng = np.random.default_rng(4)
    batch = rng.permutation(500)[:48].tolist()
    costs = rng.exponential(1.0, (48, 2))
    local = [[c.tolist() for c in np.array_split(part, 3)] for part in np.array_split(rng.permutation(48), 4)]
    result = SplitRequest(batch, costs, 3, 4).result(local, "test")
    assert result.ranks == [[[batch[p] for p in mb] for mb in rank] for rank in local]
    expected = np.array([[costs[mb].sum(axis=0) for mb in rank] for rank in local])
    np.testing.assert_array_equal(result.predicted, expected)


@pytest.mark.parametrize(
    "local", [[[[0, 1], [1, 3]]], [[[0, 1], [2, 4]]], [[[0, -1], [2, 3]]], [[[0, 1], [2]]], [[[0, 1, 2], [3, 3]]]]
)
def test_check_split_refuses_a_split_that_misses_or_repeats_a_position(local):
    with pytest.raises(ValueError, match="exactly once"):
        check_split(local, 4, 2, 1, "broken")
