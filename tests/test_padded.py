"""Padding-aware starts and their use by partition_batch when microbatches are padded."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflop_ds.schedule.padded import padded_contiguous, padded_lpt
from dflop_ds.schedule.partition import partition_batch


def padded_cost(costs, lengths):
    """Encoder adds up; LLM pays count x the per-sample LLM cost of the longest sample."""

    def cost(items):
        items = list(items)
        longest = max(items, key=lambda i: (lengths[i], costs[i, 1]))
        return np.array([costs[items, 0].sum(), len(items) * costs[longest, 1]])

    return cost


def instance(n, seed):
    rng = np.random.default_rng(seed)
    lengths = rng.lognormal(5, 1, n).round() + 1
    costs = np.stack([rng.integers(0, 8, n) * 20.0, lengths + lengths**2 / 1536], axis=1)
    return costs, lengths


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 80), extra=st.integers(0, 40), seed=st.integers(0, 10_000))
def test_padded_starts_are_partitions_with_no_empty_bucket(n, extra, seed):
    costs, lengths = instance(n + extra, seed)
    for build in (padded_lpt, padded_contiguous):
        buckets = build(costs, lengths, n)
        assert len(buckets) == n and all(buckets)
        assert sorted(i for b in buckets for i in b) == list(range(n + extra))


def test_contiguous_groups_follow_length_order():
    costs, lengths = instance(200, 1)
    buckets = padded_contiguous(costs, lengths, 10)
    spans = sorted((lengths[b].min(), lengths[b].max()) for b in buckets)
    for (_, high), (low, _) in zip(spans, spans[1:]):
        assert high <= low, "length ranges of contiguous groups must not interleave"


@pytest.mark.parametrize("n,m", [(32, 8), (256, 32), (1024, 64)])
def test_lengths_make_partition_batch_much_better_under_padding(n, m):
    costs, lengths = instance(n, 7)
    cost = padded_cost(costs, lengths)
    blind = partition_batch(costs, m, time_limit_s=0, microbatch_cost=cost)
    aware = partition_batch(costs, m, time_limit_s=0, microbatch_cost=cost, lengths=lengths)
    assert aware.makespan < 0.8 * blind.makespan
    assert aware.solver.startswith("padded")
    assert aware.makespan >= aware.lower_bound
    assert sorted(i for b in aware.buckets for i in b) == list(range(n))


def test_lengths_must_match_the_items():
    costs, lengths = instance(20, 0)
    with pytest.raises(ValueError, match="lengths"):
        partition_batch(costs, 4, time_limit_s=0, lengths=lengths[:5])
