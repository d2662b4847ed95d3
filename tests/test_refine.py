"""DFLOP's local search on the true cost of microbatches that do not add up (dflop_ds.schedule.refine)."""

from __future__ import annotations

import numpy as np
import pytest

from dflop_ds.schedule.refine import refine_split
from dflop_ds.schedule.splitters import SplitRequest, make_splitter
from dflop_ds.sync import SyncModel, step_cost
from tests.test_splitters import shapes_of
from tests.test_sync_split import typed_costs


def padded_cost(costs: np.ndarray, lengths: np.ndarray):
    """A microbatch's ``(encoder, llm)`` cost when its text is padded: the encoder adds up over
    its rows, the LLM costs every row the longest row's length (0.01 a token)."""

    def cost(rows):
        rows = list(rows)
        return np.array([costs[rows, 0].sum(), 0.01 * len(rows) * lengths[rows].max()])

    return cost


def batch(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Typed per-row costs and LLM lengths of ``n`` rows, a few of them long."""
    rng = np.random.default_rng(seed)
    return typed_costs(n, seed), np.where(rng.random(n) < 0.2, 200.0, 40.0) + rng.integers(0, 20, n)


def times(local, cost) -> np.ndarray:
    return np.array([[cost(mb) for mb in rank] for rank in local])


def interleaved(n: int, dp: int, n_mb: int) -> list[list[list[int]]]:
    """Rows dealt round-robin over every microbatch: a split blind to lengths."""
    cells = dp * n_mb
    return [[list(range(r * n_mb + k, n, cells)) for k in range(n_mb)] for r in range(dp)]


@pytest.mark.parametrize("sync", [SyncModel.MODULE, SyncModel.MICROSTEP])
def test_refining_lowers_the_padded_step_and_keeps_every_row_once(sync):
    n, dp, n_mb = 24, 2, 3
    costs, lengths = batch(n, 3)
    cost = padded_cost(costs, lengths)
    start = interleaved(n, dp, n_mb)
    before = step_cost(times(start, cost), sync)
    local, predicted = refine_split(start, times(start, cost), cost, sync)
    assert len(local) == dp and all(len(rank) == n_mb and all(rank) for rank in local)
    assert sorted(i for rank in local for mb in rank for i in mb) == list(range(n))
    np.testing.assert_allclose(predicted, times(local, cost))
    assert step_cost(predicted, sync) < 0.9 * before
    assert refine_split(start, times(start, cost), cost, sync) == (local, pytest.approx(predicted))  # deterministic


def test_refining_forms_no_microbatch_that_does_not_fit_and_stops_at_its_budget():
    n, dp, n_mb = 16, 2, 2
    costs, lengths = batch(n, 5)
    cost = padded_cost(costs, lengths)
    start = interleaved(n, dp, n_mb)  # four rows a microbatch
    local, _ = refine_split(start, times(start, cost), cost, SyncModel.MODULE, fits=lambda rows: len(rows) <= 4)
    assert max(len(mb) for rank in local for mb in rank) <= 4
    assert local != start
    unchanged, predicted = refine_split(start, times(start, cost), cost, SyncModel.MODULE, max_evaluations=0)
    assert unchanged == start
    np.testing.assert_allclose(predicted, times(start, cost))
    for other in (SyncModel.PIPELINE, SyncModel.BOUNDARY):  # ranks that do not meet every microbatch
        with pytest.raises(ValueError, match=other.value):
            refine_split(start, times(start, cost), cost, other)


def test_refining_a_large_grid_computes_at_most_its_budget_of_microbatch_costs():
    n, dp, n_mb = 1024, 128, 4
    costs, lengths = batch(n, 9)
    cost = padded_cost(costs, lengths)
    calls = []

    def counted(rows):
        calls.append(tuple(rows))
        return cost(rows)

    start = interleaved(n, dp, n_mb)
    local, predicted = refine_split(start, times(start, cost), counted, SyncModel.MODULE, max_evaluations=300)
    assert len(calls) <= 300
    assert step_cost(predicted, SyncModel.MODULE) < step_cost(times(start, cost), SyncModel.MODULE)
    np.testing.assert_allclose(predicted, times(local, cost))


@pytest.mark.parametrize("sync", ["module", "microstep"])
def test_dflop_refines_padded_microbatches_and_beats_the_baselines_on_their_true_cost(sync):
    refined = 0
    for seed in range(4):
        n, dp, n_mb = 24, 2, 2
        costs, lengths = batch(n, seed)
        cost = padded_cost(costs, lengths)
        request = SplitRequest.of_positions(
            costs, shapes_of(n, seed), n_mb, dp, sync=sync, microbatch_cost=cost, lengths=lengths
        )
        ours = make_splitter("dflop").split(request)
        refined += ours.solver.endswith("+refined")
        assert ours.step == pytest.approx(step_cost(times(ours.ranks, cost), sync))
        for name in ("stock", "verl", "batch_rebalance"):
            theirs = make_splitter(name).split(request)
            assert ours.step <= step_cost(times(theirs.ranks, cost), sync) + 1e-9, (seed, name)
    assert refined >= 2
