"""Fuzzing the partitioner: random cost matrices with zeros, huge values (1e12) and duplicates.

Invariant: every item lands in exactly one bucket, no bucket is empty, the reported makespan is
the largest recomputed bucket sum and is never below the lower bound; invalid input (NaN,
infinite or negative costs, more buckets than items) is refused with a ValueError naming it.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflop_ds.schedule.partition import partition_batch
from dflop_ds.schedule.splitters import SplitRequest, make_splitter

REL = 1e-9  # float summation order differs between the partitioner, the bound and this test
SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

values = st.one_of(
    st.sampled_from([0.0, 0.0, 1.0, 1.0, 2.0, 7.0, 1e12]),  # zeros, duplicates, huge
    st.floats(0, 1e12, allow_nan=False, allow_infinity=False),
    st.floats(0, 10, allow_nan=False, allow_infinity=False),
)


@st.composite
def instances(draw, max_items: int = 300, max_buckets: int = 12):
    """``(costs (n, k), n_buckets)`` with ``n_buckets <= n``."""
    n_buckets = draw(st.integers(1, max_buckets))
    n = draw(st.integers(n_buckets, max(n_buckets, max_items)))
    k = draw(st.sampled_from([1, 2]))
    palette = draw(st.lists(values, min_size=1, max_size=6))  # few distinct values: many duplicates
    if draw(st.booleans()):
        flat = draw(st.lists(st.sampled_from(palette), min_size=n * k, max_size=n * k))
    else:
        flat = draw(st.lists(values, min_size=n * k, max_size=n * k))
    return np.array(flat, dtype=float).reshape(n, k), n_buckets


def check_partition(part, costs: np.ndarray, n_buckets: int) -> None:
    n = costs.shape[0]
    assert len(part.buckets) == n_buckets
    assert all(part.buckets), "empty bucket"
    assert sorted(i for b in part.buckets for i in b) == list(range(n)), "an item is missing or repeated"
    loads = np.array([costs[b].sum(axis=0) for b in part.buckets])
    assert part.makespan == pytest.approx(loads.max(), rel=REL, abs=1e-9)
    assert part.makespan >= part.lower_bound * (1 - REL) - 1e-9
    assert np.isfinite(part.makespan) and part.lower_bound >= 0
    if not costs.any():
        assert part.makespan == 0


@settings(SETTINGS, max_examples=150)
@given(instances())
def test_heuristic_partition_invariants(instance):
    costs, n_buckets = instance
    check_partition(partition_batch(costs, n_buckets, time_limit_s=0), costs, n_buckets)


@settings(SETTINGS, max_examples=15)
@given(instances(max_items=16, max_buckets=4))
def test_exact_solver_partition_invariants(instance):
    costs, n_buckets = instance
    part = partition_batch(costs, n_buckets, time_limit_s=0.3)
    check_partition(part, costs, n_buckets)
    heuristic = partition_batch(costs, n_buckets, time_limit_s=0)
    assert part.makespan <= heuristic.makespan * (1 + REL) + 1e-9, "the exact solver made the split worse"


@settings(SETTINGS, max_examples=60)
@given(instances(max_items=60), st.data())
def test_one_bad_cost_is_refused_by_name(instance, data):
    costs, n_buckets = instance
    row = data.draw(st.integers(0, costs.shape[0] - 1))
    col = data.draw(st.integers(0, costs.shape[1] - 1))
    costs[row, col] = data.draw(st.sampled_from([np.nan, np.inf, -np.inf, -1.0, -1e-12]))
    with pytest.raises(ValueError, match=rf"item {row} has a negative or non-finite cost"):
        partition_batch(costs, n_buckets, time_limit_s=0)
    n_mb = data.draw(st.integers(1, n_buckets))
    if n_buckets % n_mb == 0:  # the sampler's call path refuses it the same way
        with pytest.raises(ValueError, match=rf"item {row}"):
            make_splitter("dflop").split(SplitRequest(list(range(costs.shape[0])), costs, n_mb, n_buckets // n_mb))


@settings(SETTINGS, max_examples=40)
@given(instances(max_items=20), st.integers(1, 5))
def test_too_many_buckets_is_refused(instance, extra):
    costs, _ = instance
    n = costs.shape[0]
    with pytest.raises(ValueError, match=f"cannot fill {n + extra} buckets with {n} items"):
        partition_batch(costs, n + extra, time_limit_s=0)


@pytest.mark.parametrize("n_buckets", [0, -2, 1.5])
def test_bad_bucket_count_is_refused(n_buckets):
    with pytest.raises(ValueError, match="n_buckets must be a positive integer"):
        partition_batch(np.ones((4, 2)), n_buckets, time_limit_s=0)
