"""The partitioner's candidate generators and the scorer that picks among them."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflop_ds.schedule.candidates import GENERATORS, exact_enabled
from dflop_ds.schedule.lpt import MemoryCap
from dflop_ds.schedule.partition import solve
from dflop_ds.schedule.partition_problem import Candidate, PartitionProblem, buckets_to_labels


@st.composite
def problems(draw):
    """A random problem: skewed costs, sometimes a memory cap, a padded microbatch cost, lengths
    and a node-limited exact solve."""
    n = draw(st.integers(2, 40))
    k = draw(st.integers(1, 2))
    n_buckets = draw(st.integers(1, n - 1))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    costs = rng.gamma(0.8, 10.0, size=(n, k))
    memory = None
    if draw(st.booleans()):
        usage = rng.gamma(1.0, 5.0, size=n)
        memory = MemoryCap(usage, max(usage.max(), usage.sum() / n_buckets * 1.3))
    cost = None
    if draw(st.booleans()):
        cost = lambda items: costs[list(items)].max(axis=0) * len(items)  # noqa: E731
    lengths = rng.integers(10, 500, size=n).astype(float) if draw(st.booleans()) else None
    node_limit = 50 if n * n_buckets <= 200 and draw(st.booleans()) else 0
    return PartitionProblem(
        costs, n_buckets, memory=memory, microbatch_cost=cost, lengths=lengths, time_limit_s=0.0, node_limit=node_limit
    )


@settings(max_examples=40, deadline=None)
@given(problems())
def test_every_generator_proposes_complete_splits_within_the_cap(problem):
    """Each generator, started with no incumbent and with the others' best, yields labellings that
    put every item in one of the buckets, leave no bucket empty and respect the memory cap."""
    best = None
    for generate in GENERATORS:
        for candidate in generate(problem, best):
            labels = candidate.labels
            assert labels.shape == (problem.costs.shape[0],) and candidate.solver
            assert np.bincount(labels, minlength=problem.n_buckets).min() > 0
            assert labels.max() < problem.n_buckets and problem.fits(labels)
            if best is None or problem.score(labels) < problem.score(best.labels):
                best = candidate
    assert best is not None
    assert problem.score(best.labels) >= problem.bound * (1 - 1e-9) or problem.microbatch_cost is not None


def fixed(*splits: tuple[list[list[int]], str]):
    """A generator proposing the given bucket lists, in order, whatever the incumbent."""

    def generate(problem, best):
        for buckets, name in splits:
            yield Candidate(buckets_to_labels(buckets, problem.costs.shape[0]), name)

    return generate


def test_the_scorer_keeps_the_lowest_makespan_and_the_earlier_of_equals():
    costs = np.array([4.0, 3.0, 2.0, 1.0])
    problem = PartitionProblem(costs, 2, time_limit_s=0.0)
    worse = ([[0, 1], [2, 3]], "worse")  # makespan 7
    balanced = ([[0, 3], [1, 2]], "balanced")  # 5
    same = ([[1, 2], [0, 3]], "same")  # 5, proposed later
    result = solve(problem, (fixed(worse), fixed(balanced, same)))
    assert result.solver == "balanced" and result.makespan == 5.0
    assert solve(problem, (fixed(same, balanced),)).solver == "same"


def test_the_scorer_uses_the_microbatch_cost_and_skips_splits_over_the_cap():
    costs = np.array([4.0, 3.0, 2.0, 1.0])
    padded = lambda items: np.array([costs[list(items)].max() * len(items)])  # noqa: E731
    by_size = ([[0, 1], [2, 3]], "by-size")  # padded makespan 8 (additive 7)
    mixed = ([[0, 3], [1, 2]], "mixed")  # padded makespan 8 (additive 5)
    alone = ([[0], [1, 2, 3]], "alone")  # padded makespan 9 (additive 6)
    problem = PartitionProblem(costs, 2, microbatch_cost=padded, time_limit_s=0.0)
    assert solve(problem, (fixed(alone, by_size, mixed),)).solver == "by-size"
    capped = PartitionProblem(costs, 2, memory=MemoryCap(costs, 6.0), microbatch_cost=padded, time_limit_s=0.0)
    assert solve(capped, (fixed(by_size, alone, mixed),)).solver == "mixed"  # by-size holds 7 > 6


def test_no_candidate_within_the_cap_is_an_infeasible_error_naming_the_exact_solver():
    costs = np.array([4.0, 3.0, 2.0, 1.0])
    problem = PartitionProblem(costs, 2, memory=MemoryCap(costs, 6.0), time_limit_s=0.0)
    assert not exact_enabled(problem)
    with pytest.raises(ValueError, match="exact solver was not run: raise dflop.sampler.ilp_nodes"):
        solve(problem, (fixed(([[0, 1], [2, 3]], "over")),))


def test_the_problem_names_bad_input():
    with pytest.raises(ValueError, match="lengths must have one entry per item"):
        PartitionProblem(np.ones(4), 2, lengths=np.ones(3))
    with pytest.raises(ValueError, match="node_limit"):
        PartitionProblem(np.ones(4), 2, node_limit=-1)
    with pytest.raises(ValueError, match="cannot fill 5 buckets with 4 items"):
        PartitionProblem(np.ones(4), 5)
    with pytest.raises(ValueError, match="item 2 needs memory 9 > memory_cap 5"):
        PartitionProblem(np.ones(3), 2, memory=MemoryCap(np.array([1.0, 1.0, 9.0]), 5.0))
    with pytest.raises(ValueError, match="item 1 has invalid memory nan"):
        PartitionProblem(np.ones(3), 2, memory=MemoryCap(np.array([1.0, np.nan, 9.0]), 5.0), allow_oversize=True)
