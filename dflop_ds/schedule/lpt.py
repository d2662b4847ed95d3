"""The fast half of the partitioner: starting splits, then improving moves.

Starts: vector LPT (:func:`greedy_assign`) and vector Karmarkar-Karp differencing
(:func:`differencing_assign`). Two-way splits for re-splitting a pair of buckets:
:func:`two_way_split` (differencing) and :func:`subset_split` (subset-sum DP). Improvement:
:func:`pair_sweep` (coarse levelling), :func:`improve` (moves, swaps and pair re-splits out of
the slowest bucket) and :func:`improve_with_cost` (the same with a non-additive bucket cost).

All functions are pure: they take a cost matrix ``(n, k)`` and return a bucket label per item
(an ``(n,)`` int array). A bucket's load is its summed cost per column; its time is the largest
column of its load; the makespan is the largest bucket time.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

import numpy as np

from dflop_ds.schedule.swaps import ByTime, MemoryCap, best_swap, bucket_members, exchange, items_of, swap_values

MicrobatchCost = Callable[[Sequence[int]], np.ndarray]

_INF = np.inf
#: Largest pooled pair that :func:`best_two_way_split` also splits by subset-sum DP.
SUBSET_MAX_ROWS = 512
#: Candidate swap pairs :func:`improve` evaluates in its first circle of partner buckets.
SWAP_PAIRS = 32_768


class InfeasibleError(ValueError):
    """No split satisfies the memory cap (or the greedy search could not find one)."""


def item_order(costs: np.ndarray, seed: int) -> np.ndarray:
    """Items by decreasing largest column, then decreasing total; equal items in seeded order."""
    rng = np.random.default_rng(seed)
    shuffle = rng.permutation(costs.shape[0])
    return np.lexsort((shuffle, -costs.sum(axis=1), -costs.max(axis=1)))


def greedy_assign(costs: np.ndarray, n_buckets: int, order: np.ndarray, memory: MemoryCap | None = None) -> np.ndarray:
    """Place items in ``order``, each in the bucket whose time grows the least (vector LPT).

    Ties go to the bucket with the fewest items; the last items fill any still-empty bucket, so
    no bucket stays empty. Raises :class:`InfeasibleError` when an item fits no bucket's memory.
    """
    n, k = costs.shape
    loads = np.zeros((k, n_buckets))
    counts = np.zeros(n_buckets, dtype=np.int64)
    used = np.zeros(n_buckets)
    labels = np.empty(n, dtype=np.int64)
    columns = costs.tolist()
    empty = n_buckets
    for position, item in enumerate(order.tolist()):
        row = columns[item]
        times = loads[0] + row[0]
        for c in range(1, k):
            np.maximum(times, loads[c] + row[c], out=times)
        if memory is not None:
            times[used + memory.memory[item] > memory.cap] = _INF
        if n - position <= empty:
            times[counts > 0] = _INF
        bucket = int(times.argmin())
        best = times[bucket]
        if not np.isfinite(best):
            raise InfeasibleError(
                f"item {int(item)} fits in no bucket under memory_cap={memory.cap if memory else None}"
            )
        ties = np.flatnonzero(times <= best)
        if ties.size > 1:
            bucket = int(ties[np.argmin(counts[ties])])
        labels[item] = bucket
        empty -= counts[bucket] == 0
        counts[bucket] += 1
        for c in range(k):
            loads[c, bucket] += row[c]
        if memory is not None:
            used[bucket] += memory.memory[item]
    return labels


def differencing_assign(costs: np.ndarray, n_buckets: int, equal_size: bool = True) -> np.ndarray:
    """Karmarkar-Karp largest differencing, generalised to cost vectors.

    A partial solution is ``n_buckets`` groups with summed cost vectors; its spread is the gap
    between its slowest and fastest group (time = largest column). The two partial solutions
    with the largest spreads are merged, slowest group of one with fastest of the other, until
    one remains. With ``equal_size`` the start is items in ascending order, ``n_buckets`` at a
    time, one per group (zero-cost padding fills the last ones), so every group ends with the
    same count and none is empty when ``n >= n_buckets``; otherwise each item starts alone.

    Groups are numbered, not listed: the start's slots are groups ``0..``, each merge numbers its
    ``n_buckets`` new groups and records which two groups each one joins; the final groups'
    labels are then handed down to the slots, one merge at a time.
    """
    n, k = costs.shape
    order = np.argsort(costs.max(axis=1), kind="stable")
    if equal_size:
        padded = -(-n // n_buckets) * n_buckets
        slots = np.concatenate([np.full(padded - n, -1), order])
        starts = slots.reshape(-1, n_buckets)
    else:
        starts = np.full((n, n_buckets), -1)
        starts[:, 0] = order
    padded_costs = np.vstack([costs, np.zeros((1, k))])  # index -1 is the zero padding
    sums = padded_costs[starts]
    times = sums.max(axis=2)
    rank = np.argsort(-times, axis=1, kind="stable")  # each start's groups, slowest first
    spread = np.take_along_axis(times, rank[:, :1], axis=1) - np.take_along_axis(times, rank[:, -1:], axis=1)
    group_ids = np.arange(starts.size).reshape(starts.shape)
    heap: list[tuple[float, int, np.ndarray, np.ndarray]] = [
        (-spread[tie, 0], tie, sums[tie][rank[tie]], group_ids[tie][rank[tie]]) for tie in range(starts.shape[0])
    ]
    heapq.heapify(heap)
    tie = len(heap)
    merges: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (new groups, one half, other half)
    next_id = starts.size
    while len(heap) > 1:
        _, _, sums_a, groups_a = heapq.heappop(heap)
        _, _, sums_b, groups_b = heapq.heappop(heap)
        # entries keep groups slowest first: pair slowest of a with fastest of b
        merged = np.arange(next_id, next_id + n_buckets)
        next_id += n_buckets
        merges.append((merged, groups_a, groups_b[::-1]))
        heapq.heappush(heap, _kk_entry(sums_a + sums_b[::-1], merged, tie))
        tie += 1
    label_of = np.empty(next_id, dtype=np.int64)
    label_of[heap[0][3]] = np.arange(n_buckets)
    for merged, half_a, half_b in reversed(merges):
        label_of[half_a] = label_of[merged]
        label_of[half_b] = label_of[merged]
    labels = np.empty(n, dtype=np.int64)
    real = starts.reshape(-1) >= 0
    labels[starts.reshape(-1)[real]] = label_of[: starts.size][real]
    return labels


def two_way_split(rows: list[tuple[float, ...]]) -> list[int]:
    """Two-way vector differencing in plain Python (fast for the few dozen items of a pair).

    Same rule as :func:`differencing_assign` with two groups and no size constraint; returns
    the side (0 or 1) of each row."""
    k = len(rows[0]) if rows else 1
    zero = (0.0,) * k
    # (-difference, tie-breaker, slower side's loads, faster side's loads, slower items, faster items)
    heap: list[tuple[float, int, tuple[float, ...], tuple[float, ...], list[int], list[int]]] = [
        (-max(row), i, row, zero, [i], []) for i, row in enumerate(rows)
    ]
    heapq.heapify(heap)
    tie = len(heap)
    while len(heap) > 1:
        _, _, slow_a, fast_a, items_sa, items_fa = heapq.heappop(heap)
        _, _, slow_b, fast_b, items_sb, items_fb = heapq.heappop(heap)
        one = tuple(x + y for x, y in zip(slow_a, fast_b))
        two = tuple(x + y for x, y in zip(fast_a, slow_b))
        if max(one) >= max(two):
            heapq.heappush(heap, (max(two) - max(one), tie, one, two, items_sa + items_fb, items_fa + items_sb))
        else:
            heapq.heappush(heap, (max(one) - max(two), tie, two, one, items_fa + items_sb, items_sa + items_fb))
        tie += 1
    sides = [0] * len(rows)
    for i in heap[0][5]:
        sides[i] = 1
    return sides


def subset_split(values: Sequence[float], resolution: int = 1 << 17) -> list[int]:
    """Two-way split of scalar ``values`` whose halves are as equal as the rounding allows.

    Subset-sum dynamic programming over ``values`` rounded to ``resolution`` units of their total,
    with Python integers as bitsets (one shift-or per item). Returns the side (0 or 1) of each
    value; side 1 holds the subset whose rounded sum is the largest not above half."""
    total = float(sum(values))
    if total <= 0 or len(values) < 2:
        return [0] * len(values)
    weights = [int(round(v / total * resolution)) for v in values]
    reachable = [1]
    for w in weights:
        reachable.append(reachable[-1] | (reachable[-1] << w))
    half = sum(weights) // 2
    best = (reachable[-1] & ((1 << (half + 1)) - 1)).bit_length() - 1
    sides = [0] * len(values)
    for i in range(len(values) - 1, -1, -1):
        if not (reachable[i] >> best) & 1:
            sides[i] = 1
            best -= weights[i]
    return sides


def _kk_entry(sums: np.ndarray, groups: np.ndarray, tie: int):
    """Heap entry of a partial solution: groups (numbers) sorted slowest first, keyed by largest spread."""
    times = sums.max(axis=1)
    rank = np.argsort(-times, kind="stable")
    return (-(times[rank[0]] - times[rank[-1]]), tie, sums[rank], groups[rank])


def bucket_loads(costs: np.ndarray, labels: np.ndarray, n_buckets: int) -> np.ndarray:
    """Summed cost ``(n_buckets, k)`` of each bucket."""
    loads = np.zeros((n_buckets, costs.shape[1]))
    np.add.at(loads, labels, costs)
    return loads


def _move_values(loads: np.ndarray, b: int, c_in: np.ndarray, used, memory, inside) -> np.ndarray:
    """``(p, n_buckets)``: the larger new time of bucket ``b`` and target ``q`` when item ``a``
    of ``b`` moves to ``q`` (``inf`` where not allowed). ``loads`` is ``(n_buckets, k)``."""
    k = loads.shape[1]
    value = np.maximum.reduce([loads[None, :, c] + c_in[:, c, None] for c in range(k)])
    stay = np.maximum.reduce([loads[b, c] - c_in[:, c] for c in range(k)])
    np.maximum(value, stay[:, None], out=value)
    value[:, b] = _INF
    if used is not None:
        value[used[None, :] + memory.memory[inside][:, None] > memory.cap] = _INF
    return value


def improve(
    costs: np.ndarray,
    labels: np.ndarray,
    n_buckets: int,
    memory: MemoryCap | None = None,
    max_rounds: int = 20_000,
    partners: Sequence[int] = (12, 48),
    resplit: int = 8,
    target: float = 0.0,
    allow_moves: bool = True,
) -> np.ndarray:
    """Lower the makespan by moving or swapping items out of the slowest bucket.

    Each round takes the slowest bucket ``b`` and evaluates, all at once, every move of one of its
    items to another bucket and every swap of one of its items with an item elsewhere; it applies
    the one that leaves the larger of the two touched buckets smallest, if that is below ``b``'s
    time. Every applied change strictly lowers the number of buckets at the current makespan or
    the makespan itself, so the search terminates (and it is deterministic: no clock involved).
    Swaps are sought with the ``partners[0]`` lightest buckets first (fast), then with the
    ``partners[1]`` lightest, and so on (pass a size ``>= n_buckets`` to end with all buckets).
    When no single move or swap helps, the slowest bucket and each of the ``resplit`` lightest
    buckets in turn are pooled and split afresh (best_two_way_split); the first re-split
    that lowers both below the slowest time is kept, and the search goes on. The search stops
    early once the makespan is at most ``target`` (e.g. a lower bound). With
    ``allow_moves=False`` and ``resplit=0`` only swaps are made, so bucket sizes never change.
    A move never empties a bucket or breaks the memory cap. A round's best swap is the one
    scoring every pair of its circle would pick; in large circles a lower bound leaves out, before
    scoring, the items that cannot be part of it (:func:`~dflop_ds.schedule.swaps.best_swap`).
    """
    labels = labels.copy()
    loads = bucket_loads(costs, labels, n_buckets)
    times = loads.max(axis=1)  # kept in step with ``loads`` for the buckets each change touches
    counts = np.bincount(labels, minlength=n_buckets)
    used = np.bincount(labels, weights=memory.memory, minlength=n_buckets) if memory is not None else None
    slack = 1e-9 * float(costs.sum())  # above any rounding of loads and costs (each at most the total)
    work = [np.empty(0)]  # the swap matrices' memory, reused round after round
    circles = any(width < n_buckets for width in partners)  # some circle of the lightest buckets
    members = bucket_members(labels, n_buckets) if circles else []
    by_time = ByTime(times) if circles else None
    for _ in range(max_rounds):
        b = int(times.argmax())
        if times[b] <= target:
            break
        inside = np.sort(members[b]) if circles else np.flatnonzero(labels == b)
        best_value, best_change = times[b] * (1.0 - 1e-12), None
        if allow_moves and counts[b] > 1:
            value = _move_values(loads, b, costs[inside], used, memory, inside)
            flat = int(value.argmin())
            if value.flat[flat] < best_value:
                best_value, best_change = value.flat[flat], (inside[flat // n_buckets], -1, flat % n_buckets)
        # Swaps with the lightest buckets usually win: look there first, then a wider circle.
        # With big buckets the swap matrix grows as (items per bucket)^2: shrink the circles so
        # that the first holds about SWAP_PAIRS candidate pairs.
        shrink = max(1.0, inside.size * costs.shape[0] / n_buckets * partners[0] / SWAP_PAIRS)
        for size in (max(1, int(width / shrink)) if width < n_buckets else width for width in partners):
            if size >= n_buckets:
                outside = np.flatnonzero(labels != b)
            else:
                assert by_time is not None
                outside = items_of(members, by_time.lightest(size, b), labels)
            swap = best_swap(costs, loads, labels, b, inside, outside, used, memory, best_value, slack, work)
            if swap is not None:
                best_value, best_change = swap
            if best_change is not None or size >= n_buckets:
                break
        if best_change is None:
            partners_of_b = np.argsort(times, kind="stable")[:resplit] if resplit > 0 else None
            if partners_of_b is None or not _resplit_pair(costs, labels, loads, counts, used, memory, b, partners_of_b):
                break
            times = loads.max(axis=1)
            if circles:
                members, by_time = bucket_members(labels, n_buckets), ByTime(times)
            continue
        item, other, destination = (int(v) for v in best_change)
        _relabel(item, destination, costs, labels, loads, counts, used, memory)
        if other >= 0:
            _relabel(other, b, costs, labels, loads, counts, used, memory)
        new_b, new_destination = float(loads[b].max()), float(loads[destination].max())
        if by_time is not None:
            exchange(members, b, destination, item, other)
            by_time.update(b, float(times[b]), new_b)
            by_time.update(destination, float(times[destination]), new_destination)
        times[b], times[destination] = new_b, new_destination
    return labels


def best_two_way_split(rows: np.ndarray) -> np.ndarray:
    """The better (smaller slower half) of :func:`two_way_split` and :func:`subset_split` on the
    column with the largest total, as a 0/1 side per row of ``rows`` (``(p, k)``). The subset
    DP keeps one bitset per row, so it is skipped beyond ``SUBSET_MAX_ROWS`` rows."""
    candidates = [two_way_split([tuple(r) for r in rows.tolist()])]
    if rows.shape[0] <= SUBSET_MAX_ROWS:
        column = int(rows.sum(axis=0).argmax())
        candidates.append(subset_split(rows[:, column].tolist()))
    best, best_value = None, np.inf
    for sides in candidates:
        side = np.asarray(sides, dtype=np.int64)
        value = max(rows[side == 0].sum(axis=0).max(initial=0.0), rows[side == 1].sum(axis=0).max(initial=0.0))
        if value < best_value and 0 < side.sum() < side.size:
            best, best_value = side, value
    return best if best is not None else np.asarray(candidates[0], dtype=np.int64)


def pair_sweep(costs: np.ndarray, labels: np.ndarray, n_buckets: int, memory: MemoryCap | None = None) -> np.ndarray:
    """One sweep of pairwise re-splits: the i-th slowest bucket is pooled with the i-th fastest
    and the pair split afresh by :func:`best_two_way_split`, kept where it lowers the pair's slower
    time (and respects the memory cap, leaving neither empty). A coarse, fast leveller to run
    before :func:`improve`, which then only polishes."""
    labels = labels.copy()
    times = bucket_loads(costs, labels, n_buckets).max(axis=1)
    order = np.argsort(times, kind="stable")
    members: list[list[int]] = [[] for _ in range(n_buckets)]
    for item, bucket in enumerate(labels.tolist()):
        members[bucket].append(item)
    for i in range(n_buckets // 2):
        slow, fast = int(order[-1 - i]), int(order[i])
        pooled = members[slow] + members[fast]
        sides = best_two_way_split(costs[pooled])
        left = [j for j, side in zip(pooled, sides.tolist()) if side == 0]
        right = [j for j, side in zip(pooled, sides.tolist()) if side == 1]
        if not left or not right:
            continue
        new_max = max(costs[left].sum(axis=0).max(), costs[right].sum(axis=0).max())
        if new_max >= times[slow] * (1.0 - 1e-12):
            continue
        if memory is not None and max(memory.memory[left].sum(), memory.memory[right].sum()) > memory.cap:
            continue
        labels[left], labels[right] = slow, fast
    return labels


def _resplit_pair(costs, labels, loads, counts, used, memory, b: int, partners: np.ndarray) -> bool:
    """Re-split bucket ``b`` with one of ``partners`` by :func:`best_two_way_split` (in place).

    Returns True when a re-split lowered the larger of the pair below ``b``'s time, kept both
    non-empty and respected the memory cap."""
    worst = loads[b].max() * (1.0 - 1e-12)
    for q in partners.tolist():
        if q == b:
            continue
        pooled = np.flatnonzero((labels == b) | (labels == q))
        halves = best_two_way_split(costs[pooled])
        sizes = np.bincount(halves, minlength=2)
        if sizes.min() == 0:
            continue
        pair_loads = bucket_loads(costs[pooled], halves, 2)
        if pair_loads.max() >= worst:
            continue
        if used is not None:
            pair_used = np.bincount(halves, weights=memory.memory[pooled], minlength=2)
            if pair_used.max() > memory.cap:
                continue
            used[b], used[q] = pair_used
        labels[pooled] = np.where(halves == 0, b, q)
        loads[b], loads[q] = pair_loads
        counts[b], counts[q] = sizes
        return True
    return False


def _relabel(item, bucket, costs, labels, loads, counts, used, memory) -> None:
    """Move ``item`` to ``bucket``, keeping loads, counts and memory use in step (in place)."""
    source = labels[item]
    loads[source] -= costs[item]
    loads[bucket] += costs[item]
    counts[source] -= 1
    counts[bucket] += 1
    if used is not None:
        used[source] -= memory.memory[item]
        used[bucket] += memory.memory[item]
    labels[item] = bucket


def labels_to_buckets(labels: np.ndarray, n_buckets: int, items: np.ndarray | None = None) -> list[list[int]]:
    """Bucket label per item -> list of item-index lists (items ascending within a bucket).

    With ``items``, entry ``i`` of a bucket list is ``items[i]`` instead of ``i`` (in the order of
    ``i``): e.g. labels per position of an ordering, ``items`` the ordering."""
    labels = np.asarray(labels, dtype=np.int64)
    if labels.size and not 0 <= labels.min() <= labels.max() < n_buckets:
        raise ValueError(f"bucket labels must lie in 0..{n_buckets - 1}, got {labels.min()}..{labels.max()}")
    grouped = np.argsort(labels, kind="stable")
    flat = (grouped if items is None else np.asarray(items)[grouped]).tolist()
    ends = np.cumsum(np.bincount(labels, minlength=n_buckets)).tolist()
    return [flat[start:end] for start, end in zip([0, *ends[:-1]], ends)]


def true_times(buckets: Sequence[Sequence[int]], microbatch_cost: MicrobatchCost, k: int) -> np.ndarray:
    """``(n_buckets, k)`` costs of each bucket by ``microbatch_cost``, shape-checked."""
    answers = [microbatch_cost(list(bucket)) for bucket in buckets]
    try:
        times = np.array(answers, dtype=float)
    except (TypeError, ValueError):  # ragged or not numbers: the check below names the bucket
        times = np.empty(0)
    if times.shape == (len(buckets), k) and np.isfinite(times).all():
        return times
    rows = []
    for index, answer in enumerate(answers):
        row = np.asarray(answer, dtype=float).reshape(-1)
        if row.shape != (k,) or not np.isfinite(row).all():
            raise ValueError(f"microbatch_cost of bucket {index} returned {row.tolist()}, expected {k} finite numbers")
        rows.append(row)
    return np.array(rows).reshape(len(buckets), k)


def improve_with_cost(
    costs: np.ndarray,
    labels: np.ndarray,
    n_buckets: int,
    microbatch_cost: MicrobatchCost,
    memory: MemoryCap | None = None,
    candidates: int = 12,
    max_rounds: int = 500,
) -> np.ndarray:
    """Like :func:`improve`, but bucket times come from ``microbatch_cost`` (non-additive costs).

    The slowest bucket by the true cost is the one worked on; every move and swap out of it is
    ranked by its additive estimate (true loads plus the items' additive costs), and only the
    ``candidates`` most promising are evaluated exactly. The best exact improvement is applied,
    for at most ``max_rounds`` rounds (no clock: the result is deterministic).
    """
    labels = labels.copy()
    k = costs.shape[1]
    buckets = [set(b) for b in labels_to_buckets(labels, n_buckets)]
    loads = true_times([sorted(b) for b in buckets], microbatch_cost, k)
    used = np.bincount(labels, weights=memory.memory, minlength=n_buckets) if memory is not None else None
    everyone = np.arange(costs.shape[0])
    for _ in range(max_rounds):
        times = loads.max(axis=1)
        b = int(times.argmax())
        worst = times[b]
        inside = everyone[labels == b]
        outside = everyone[labels != b]
        changes: list[tuple[float, int, int, int]] = []  # (estimate, item, other or -1, target)
        if inside.size > 1:
            value = _move_values(loads, b, costs[inside], used, memory, inside)
            for flat in np.argsort(value, axis=None, kind="stable")[:candidates]:
                a, q = divmod(int(flat), n_buckets)
                if np.isfinite(value[a, q]):
                    changes.append((float(value[a, q]), int(inside[a]), -1, q))
        if outside.size:
            value = swap_values(costs, loads, labels, b, inside, outside, used, memory)
            for flat in np.argsort(value, axis=None, kind="stable")[:candidates]:
                a, z = divmod(int(flat), outside.size)
                if np.isfinite(value[a, z]):
                    changes.append((float(value[a, z]), int(inside[a]), int(outside[z]), int(labels[outside[z]])))
        changes.sort()
        best = None
        for _, item, other, target in changes[:candidates]:
            new_b = buckets[b] - {item}
            new_t = buckets[target] | {item}
            if other >= 0:
                new_b = new_b | {other}
                new_t = new_t - {other}
            row_b = true_times([sorted(new_b)], microbatch_cost, k)[0]
            row_t = true_times([sorted(new_t)], microbatch_cost, k)[0]
            value = max(row_b.max(), row_t.max())
            if value < worst * (1.0 - 1e-12) and (best is None or value < best[0]):
                best = (value, item, other, target, new_b, new_t, row_b, row_t)
        if best is None:
            break
        _, item, other, target, new_b, new_t, row_b, row_t = best
        buckets[b], buckets[target] = new_b, new_t
        loads[b], loads[target] = row_b, row_t
        labels[item] = target
        if other >= 0:
            labels[other] = b
        if used is not None and memory is not None:
            used[b] = memory.memory[sorted(new_b)].sum()
            used[target] = memory.memory[sorted(new_t)].sum()
    return labels
