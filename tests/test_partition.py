"""Properties of partition_batch (heuristic, bounds, ILP, memory cap, non-additive costs)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflop_ds.schedule.ilp import solve_ilp
from dflop_ds.schedule.lower_bounds import lower_bound
from dflop_ds.schedule.lpt import bucket_loads, greedy_assign, item_order
from dflop_ds.schedule.partition import InfeasibleError, partition_batch


@st.composite
def instances(draw, max_items: int = 40, max_k: int = 2):
    """A random cost matrix (skewed costs, some zeros) and a feasible bucket count."""
    n = draw(st.integers(1, max_items))
    k = draw(st.integers(1, max_k))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    costs = rng.gamma(0.7, 10.0, size=(n, k)) * (rng.random((n, k)) > 0.1)
    n_buckets = draw(st.integers(1, n))
    return costs, n_buckets


def assert_valid(partition, costs: np.ndarray, n_buckets: int) -> None:
    """Every item exactly once, no empty bucket, reported makespan and bound consistent."""
    assert len(partition.buckets) == n_buckets
    assert all(len(bucket) > 0 for bucket in partition.buckets)
    assert sorted(i for bucket in partition.buckets for i in bucket) == list(range(len(costs)))
    matrix = costs.reshape(len(costs), -1)
    recomputed = max(matrix[bucket].sum(axis=0).max() for bucket in partition.buckets)
    assert partition.makespan == pytest.approx(recomputed, rel=1e-9, abs=1e-12)
    assert partition.makespan >= partition.lower_bound * (1 - 1e-9) - 1e-12


@settings(max_examples=60, deadline=None)
@given(instances())
def test_heuristic_split_is_valid_and_above_bound(instance):
    costs, n_buckets = instance
    partition = partition_batch(costs, n_buckets, time_limit_s=0)
    assert_valid(partition, costs, n_buckets)
    assert partition.solver in {"lpt", "lpt+moves"}


@settings(max_examples=40, deadline=None)
@given(instances(max_items=30))
def test_lower_bound_is_valid_against_brute_force_on_tiny_instances(instance):
    costs, n_buckets = instance
    costs, n_buckets = costs[:7], min(n_buckets, 3, len(costs[:7]))
    best = np.inf
    for labels in itertools.product(range(n_buckets), repeat=len(costs)):
        labels = np.array(labels)
        if np.bincount(labels, minlength=n_buckets).min() == 0:
            continue
        best = min(best, bucket_loads(costs, labels, n_buckets).max())
    assert lower_bound(costs, n_buckets) <= best * (1 + 1e-9) + 1e-12
    assert partition_batch(costs, n_buckets, time_limit_s=0).makespan >= best * (1 - 1e-9) - 1e-12


def test_lower_bound_includes_column_average_and_largest_item():
    costs = np.array([[10.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 30.0]])
    bound = lower_bound(costs, 2)
    assert bound >= 30.0
    assert bound >= costs.sum(axis=0).max() / 2
    # pigeonhole: 3 items of 5 into 2 buckets -> some bucket holds two of them
    assert lower_bound(np.array([5.0, 5.0, 5.0]), 2) == 10.0


@settings(max_examples=30, deadline=None)
@given(instances(), st.integers(0, 5))
def test_same_seed_gives_the_same_answer(instance, seed):
    costs, n_buckets = instance
    first = partition_batch(costs, n_buckets, time_limit_s=0, seed=seed)
    second = partition_batch(costs, n_buckets, time_limit_s=0, seed=seed)
    assert first.buckets == second.buckets
    assert first.makespan == second.makespan


@settings(max_examples=40, deadline=None)
@given(instances(max_k=1))
def test_one_column_and_one_dimensional_input_agree(instance):
    costs, n_buckets = instance
    flat = partition_batch(costs[:, 0], n_buckets, time_limit_s=0)
    column = partition_batch(costs[:, :1], n_buckets, time_limit_s=0)
    assert_valid(flat, costs[:, 0], n_buckets)
    assert flat.buckets == column.buckets


@settings(max_examples=40, deadline=None)
@given(instances(max_items=30), st.integers(0, 2**31 - 1))
def test_memory_cap_is_honoured(instance, seed):
    costs, n_buckets = instance
    rng = np.random.default_rng(seed)
    memory = rng.uniform(1.0, 10.0, size=len(costs))
    # a cap with room to spare: the largest item fits and total memory fits with slack
    cap = max(memory.max(), 1.5 * memory.sum() / n_buckets)
    partition = partition_batch(costs, n_buckets, memory=memory, memory_cap=cap, time_limit_s=0)
    assert_valid(partition, costs, n_buckets)
    assert max(memory[bucket].sum() for bucket in partition.buckets) <= cap + 1e-9


def test_memory_cap_changes_the_split_when_binding():
    costs = np.array([10.0, 10.0, 1.0, 1.0])
    memory = np.array([5.0, 1.0, 5.0, 1.0])
    free = partition_batch(costs, 2, time_limit_s=0)
    capped = partition_batch(costs, 2, memory=memory, memory_cap=6.0, time_limit_s=0)
    assert free.makespan == 11.0
    assert all(memory[b].sum() <= 6.0 for b in capped.buckets)
    assert capped.makespan == 11.0


def test_item_over_the_cap_is_named():
    memory = np.array([1.0, 2.0, 9.0, 1.0])
    with pytest.raises(ValueError, match="item 2"):
        partition_batch(np.ones(4), 2, memory=memory, memory_cap=5.0)


def test_infeasible_memory_raises_clearly():
    memory = np.array([4.0, 4.0, 4.0])
    with pytest.raises(InfeasibleError, match="memory"):
        partition_batch(np.ones(3), 2, memory=memory, memory_cap=5.0)
    # total fits but no packing does: 3+3+3 into two buckets of 5 (found infeasible by the ILP)
    with pytest.raises(InfeasibleError):
        partition_batch(np.ones(3), 2, memory=np.array([3.0, 3.0, 3.0]), memory_cap=5.0)


def test_too_few_items_and_bad_input_raise():
    with pytest.raises(ValueError, match="no bucket may be empty"):
        partition_batch(np.ones(3), 4)
    with pytest.raises(ValueError, match="item 1"):
        partition_batch(np.array([1.0, -1.0, 2.0]), 2)
    with pytest.raises(ValueError, match="together"):
        partition_batch(np.ones(3), 2, memory=np.ones(3))


def test_zero_costs_still_fill_every_bucket():
    partition = partition_batch(np.zeros((6, 2)), 6, time_limit_s=0)
    assert sorted(len(b) for b in partition.buckets) == [1] * 6


# Instances found by random search where the whole heuristic (time_limit_s=0) stops above the
# optimum, so only the ILP reaches it.
CRAFTED = [
    (np.array([9, 4, 14, 29, 4, 12, 12, 27, 6, 15], dtype=float), 3),
    (
        np.array(
            [[16, 4], [12, 21], [8, 17], [19, 13], [29, 27], [19, 25], [24, 7], [8, 5], [4, 27], [12, 5]], dtype=float
        ),
        3,
    ),
]


def brute_force_optimum(costs: np.ndarray, n_buckets: int) -> float:
    """Smallest makespan over every labelling with no empty bucket."""
    matrix = costs.reshape(len(costs), -1)
    labels = np.array(list(itertools.product(range(n_buckets), repeat=len(matrix))))
    onehot = labels[:, :, None] == np.arange(n_buckets)[None, None, :]
    loads = np.einsum("lib,ik->lbk", onehot.astype(float), matrix)
    feasible = onehot.any(axis=1).all(axis=1)
    return float(loads.max(axis=(1, 2))[feasible].min())


def test_crafted_instances_defeat_the_heuristic():
    gaps = [partition_batch(c, m, time_limit_s=0).makespan - brute_force_optimum(c, m) for c, m in CRAFTED]
    assert max(gaps) > 0, "the heuristic now solves every crafted instance: find harder ones"


@pytest.mark.parametrize("costs, n_buckets", CRAFTED)
def test_ilp_reaches_the_optimum_where_the_heuristic_stops(costs, n_buckets):
    optimum = brute_force_optimum(costs, n_buckets)
    heuristic = partition_batch(costs, n_buckets, time_limit_s=0)
    exact = partition_batch(costs, n_buckets, time_limit_s=10)
    assert_valid(exact, costs, n_buckets)
    assert exact.makespan == pytest.approx(optimum)
    if heuristic.makespan > optimum:
        assert exact.solver == "ilp-optimal"
    # plain LPT alone is worse than the optimum on these instances
    matrix = costs.reshape(len(costs), -1)
    lpt = greedy_assign(matrix, n_buckets, item_order(matrix, 0))
    assert bucket_loads(matrix, lpt, n_buckets).max() > optimum


def test_ilp_beats_plain_lpt_from_its_warm_start():
    costs = np.array([[3.0], [3.0], [2.0], [2.0], [2.0]])
    order = item_order(costs, 0)
    lpt = greedy_assign(costs, 2, order)
    assert bucket_loads(costs, lpt, 2).max() == 7.0
    result = solve_ilp(costs, 2, order, lower=6.0, upper=7.0, warm_labels=lpt, time_limit_s=10)
    assert result.optimal
    assert bucket_loads(costs, result.labels, 2).max() == 6.0


def test_microbatch_cost_is_honoured():
    """Padding cost: a bucket costs its size times its longest item, so mixing long and short
    items is expensive. The additive optimum ({10, 10} | {10, 1, 1, 1}) pads to 40; grouping
    by length ({10, 10, 10} | {1, 1, 1}) costs 30."""
    lengths = np.array([10.0, 10.0, 10.0, 1.0, 1.0, 1.0])

    def padded(items):
        return np.array([len(items) * lengths[items].max()])

    additive = partition_batch(lengths, 2, time_limit_s=0)
    aware = partition_batch(lengths, 2, time_limit_s=0, microbatch_cost=padded)
    assert sorted(len(b) for b in aware.buckets) == [3, 3]
    assert aware.makespan == pytest.approx(max(padded(b)[0] for b in aware.buckets))
    assert aware.additive_makespan == pytest.approx(max(lengths[b].sum() for b in aware.buckets))
    assert aware.makespan < max(padded(b)[0] for b in additive.buckets)
    assert aware.bucket_costs.shape == (2, 1)


def test_microbatch_cost_with_wrong_shape_is_rejected():
    with pytest.raises(ValueError, match="bucket"):
        partition_batch(np.ones((4, 2)), 2, time_limit_s=0, microbatch_cost=lambda items: np.ones(3))


def test_one_item_per_bucket_skips_the_search(monkeypatch):
    """With as many buckets as items the only split is one item per bucket: partition_batch
    answers without the local search (the planner's final splits at thousands of GPUs are such),
    measuring every bucket with the microbatch cost."""
    import dflop_ds.schedule.candidates as candidates_module

    def refuse(*args, **kwargs):
        raise AssertionError("the local search ran for a split with one item per bucket")

    for name in ("pair_sweep", "improve", "improve_with_cost", "padded_lpt"):
        monkeypatch.setattr(candidates_module, name, refuse)
    costs = np.random.default_rng(0).gamma(0.7, 10.0, size=(300, 2))
    padded = lambda items: costs[items].max(axis=0) * len(items)  # noqa: E731
    lengths = np.arange(300, dtype=float)
    result = partition_batch(costs, 300, time_limit_s=0.0, microbatch_cost=padded, lengths=lengths)
    assert sorted(len(b) for b in result.buckets) == [1] * 300
    assert sorted(i for b in result.buckets for i in b) == list(range(300))
    assert np.allclose(result.bucket_costs, [costs[b[0]] for b in result.buckets])
    assert result.makespan == pytest.approx(costs.max(axis=1).max())
    assert result.makespan == pytest.approx(result.lower_bound)
