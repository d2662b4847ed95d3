"""The splitter contract's sync model and memory budget, and DFLOP's split under each sync model."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflop_ds.schedule.aligned import (
    _grid_score,
    _grouped,
    aligned_split,
    improve_grid,
    layered_groups,
    microstep_groups,
)
from dflop_ds.schedule.splitters import MemoryBudget, SplitRequest, make_splitter, splitter_names
from dflop_ds.sync import SyncModel, step_cost, step_lower_bound
from tests.test_splitters import shapes_of
from tests.test_sync import _optimum

SYNCS = ("boundary", "microstep", "module")


def typed_costs(n: int, seed: int) -> np.ndarray:
    """``(n, 2)`` encoder and LLM costs of a few sample types (text, image, video) with noise,
    as real batches have them: the columns are not proportional across types."""
    rng = np.random.default_rng(seed)
    types = np.array([[0.0, 0.05], [1.2, 1.0], [0.8, 2.5], [0.2, 0.55]])
    picked = types[rng.integers(0, len(types), n)]
    return picked * rng.uniform(0.95, 1.05, size=(n, 2))


def times_of(costs: np.ndarray, local: list[list[list[int]]]) -> np.ndarray:
    """``(dp, n_mb, c)`` summed costs of each microbatch of ``local`` (rows of ``costs``)."""
    return np.array([[costs[mb].sum(axis=0) for mb in rank] for rank in local])


@settings(max_examples=30, deadline=None)
@given(n_mb=st.integers(1, 4), dp=st.integers(1, 5), extra=st.integers(0, 12), seed=st.integers(0, 2**16))
def test_aligned_split_places_every_row_once_in_non_empty_microbatches(n_mb, dp, extra, seed):
    costs = typed_costs(n_mb * dp + extra, seed)
    local = aligned_split(costs, dp, n_mb)
    assert len(local) == dp and all(len(rank) == n_mb and all(rank) for rank in local)
    assert sorted(i for rank in local for mb in rank for i in mb) == list(range(costs.shape[0]))
    assert aligned_split(costs, dp, n_mb) == local  # deterministic


def test_microstep_groups_hold_alike_samples_together():
    costs = typed_costs(64, 3)
    groups = microstep_groups(costs, 4, "first")
    assert [g.size for g in groups] == [16] * 4
    encoder = [costs[g, 0] for g in groups]
    assert all(encoder[k].min() >= encoder[k + 1].max() for k in range(3))  # decreasing encoder cost
    with pytest.raises(ValueError, match="grouping key"):
        microstep_groups(costs, 4, "fancy")


@pytest.mark.parametrize("dp,per_rank,n_mb,extra", [(4, 8, 4, 0), (8, 6, 3, 0), (5, 4, 2, 3), (3, 40, 4, 0)])
def test_layered_groups_cut_whole_layers_and_beat_equal_counts(dp, per_rank, n_mb, extra):
    costs = typed_costs(dp * per_rank + extra, dp + per_rank)
    for balanced in (False, True):
        groups = layered_groups(costs, dp, n_mb, balanced)
        assert len(groups) == n_mb
        assert sorted(np.concatenate(groups).tolist()) == list(range(costs.shape[0]))
        assert all(g.size >= dp and g.size % dp == 0 for g in groups[:-1]) and groups[-1].size >= dp
    if extra == 0 and per_rank <= 16 and per_rank % n_mb == 0:
        # the equal-count groups are runs of whole layers: the balanced programme never scores above them
        layered = _grid_score(costs, _grouped(costs, dp, layered_groups(costs, dp, n_mb, True)), dp, n_mb)
        equal = _grid_score(costs, _grouped(costs, dp, microstep_groups(costs, n_mb, "first")), dp, n_mb)
        assert layered <= equal * (1 + 1e-12)


def test_improve_grid_never_raises_the_module_step():
    rng = np.random.default_rng(5)
    for _ in range(20):
        dp, n_mb = int(rng.integers(2, 6)), int(rng.integers(1, 4))
        costs = typed_costs(dp * n_mb * 2 + int(rng.integers(0, 5)), int(rng.integers(1 << 16)))
        cells = np.concatenate([np.arange(dp * n_mb), rng.integers(0, dp * n_mb, costs.shape[0] - dp * n_mb)])
        rng.shuffle(cells)
        before = np.zeros((n_mb * dp, 2))
        np.add.at(before, cells, costs)
        improved = improve_grid(costs, cells, dp, n_mb, rounds=64)
        after = np.zeros((n_mb * dp, 2))
        np.add.at(after, improved, costs)
        assert np.bincount(improved, minlength=dp * n_mb).min() >= 1
        assert (
            step_cost(after.reshape(n_mb, dp, 2).transpose(1, 0, 2), "module")
            <= step_cost(before.reshape(n_mb, dp, 2).transpose(1, 0, 2), "module") + 1e-9
        )


def test_improve_grid_moves_past_ranks_tied_at_the_maximum():
    # both ranks of microstep 0 tied at 1.25: no single change out of one of them lowers the
    # step, yet the search reaches the brute-force optimum
    costs = np.array([[1.0], [0.25], [1.0], [0.25], [0.6], [0.1], [0.05]])
    cells = np.array([0, 0, 1, 1, 2, 3, 3])  # microstep * 2 + rank
    improved = improve_grid(costs, cells, 2, 2, rounds=8)
    loads = np.zeros((4, 1))
    np.add.at(loads, improved, costs)
    assert loads.reshape(2, 2).max(axis=1).sum() == pytest.approx(_optimum(costs, 2, 2, "module"))


@pytest.mark.parametrize("sync", SYNCS)
def test_dflop_is_never_worse_than_stock_or_the_old_split_and_reports_its_step(sync):
    for seed in range(4):
        dp, n_mb = 8, 4
        costs = typed_costs(dp * n_mb * 2, seed)
        shapes = shapes_of(costs.shape[0], seed)
        request = SplitRequest.of_positions(costs, shapes, n_mb, dp, sync=sync)
        ours = make_splitter("dflop").split(request)
        assert ours.sync is SyncModel(sync)
        assert ours.step == pytest.approx(step_cost(ours.predicted, sync))
        assert ours.lower_bound == pytest.approx(step_lower_bound(costs, dp, n_mb, sync))
        assert ours.lower_bound <= ours.step + 1e-9
        stock = make_splitter("stock").split(request)
        assert ours.step <= stock.step + 1e-9
        pipelined = make_splitter("dflop").split(SplitRequest.of_positions(costs, shapes, n_mb, dp))
        assert ours.step <= step_cost(pipelined.predicted, sync) + 1e-9  # the pre-sync split is a candidate


def test_module_split_aligns_the_columns_where_the_summed_balance_does_not():
    """Encoder-heavy and LLM-heavy samples of the same total: balancing the summed column
    happily crosses them within a microstep; under module each column waits on its own."""
    dp, n_mb = 4, 2
    costs = np.array([[3.0, 1.0]] * 8 + [[1.0, 3.0]] * 8)
    shapes = shapes_of(16, 0)
    module = make_splitter("dflop").split(SplitRequest.of_positions(costs, shapes, n_mb, dp, sync="module"))
    assert module.step == pytest.approx(step_lower_bound(costs, dp, n_mb, "module"))  # 16: each column meets alone
    crossed = np.array([[[4.0, 4.0], [4.0, 4.0]]] * dp)  # a microbatch of one of each kind
    assert module.step < step_cost(crossed * [[[1.5, 0.5], [0.5, 1.5]]], "module") + 1e-9


def test_the_trainer_logs_the_predicted_step_over_its_bound_under_the_sync_model():
    """Under module sync DFLOP aligns a heavy microstep with a light one on every rank, so its
    slowest / mean microbatch is far from 1 while its step sits at the bound: the log says both."""
    from dflop_ds.hf_trainer.sampler import ScheduleLog
    from dflop_ds.schedule.batch_schedule import BatchSchedule

    dp, n_mb = 2, 2
    costs = np.array([[3.0, 1.0]] * 2 + [[0.1, 0.1]] * 2)
    split = make_splitter("dflop").split(SplitRequest.of_positions(costs, shapes_of(4, 0), n_mb, dp, sync="module"))
    schedule = BatchSchedule(0, 0, split, 1.0, 4, 0.01)
    assert schedule.step_over_bound() == pytest.approx(split.step / split.lower_bound)
    assert schedule.step_over_bound() == pytest.approx(1.0) and float(np.max(schedule.imbalance())) > 1.8
    log = ScheduleLog()
    log.add(schedule)
    drained = log.drain()
    assert drained["dflop_predicted_step_over_bound"] == pytest.approx(1.0)
    assert drained["dflop_predicted_imbalance"] > 1.8 and log.drain() == {}
    unbounded = BatchSchedule(0, 1, dataclasses.replace(split, lower_bound=0.0), 1.0, 4, 0.01)
    log.add(unbounded)
    assert unbounded.step_over_bound() is None and "dflop_predicted_step_over_bound" not in log.drain()


def test_the_pipeline_default_keeps_the_makespan_semantics():
    costs = typed_costs(32, 1)
    request = SplitRequest.of_positions(costs, shapes_of(32, 1), 2, 4)
    result = make_splitter("dflop").split(request)
    assert request.sync is SyncModel.PIPELINE and result.sync is SyncModel.PIPELINE
    assert result.step == result.makespan and result.lower_bound <= result.makespan + 1e-9


def test_every_splitter_reports_its_step_under_the_requests_sync_model():
    costs = typed_costs(24, 2)
    shapes = shapes_of(24, 2)
    for name in splitter_names():
        for sync in SYNCS:
            result = make_splitter(name).split(SplitRequest.of_positions(costs, shapes, 3, 2, sync=sync))
            assert result.step == pytest.approx(step_cost(result.predicted, sync)), (name, sync)


def test_a_memory_budget_is_respected_and_checked():
    costs = typed_costs(32, 4)
    shapes = shapes_of(32, 4)
    rows = np.where(costs[:, 0] > 0.5, 3.0, 1.0)  # bytes: media samples weigh more
    budget = MemoryBudget(9.0, rows)
    for sync in ("pipeline", *SYNCS):
        request = SplitRequest.of_positions(costs, shapes, 4, 2, sync=sync, memory=budget)
        result = make_splitter("dflop").split(request)
        assert all(rows[mb].sum() <= 9.0 for rank in result.ranks for mb in rank if len(mb) > 1), sync
    with pytest.raises(ValueError, match="per-row bytes"):
        SplitRequest.of_positions(costs, shapes, 4, 2, memory=MemoryBudget(4.0, rows[:5]))
    with pytest.raises(ValueError, match="memory cap"):
        MemoryBudget(0.0, rows)
    with pytest.raises(ValueError, match="unknown sync model"):
        SplitRequest.of_positions(costs, shapes, 4, 2, sync="zero9")


def test_padded_microbatch_bytes_are_re_weighted_until_they_fit():
    """Rows cost little alone but a microbatch pays its longest row per row (padding): the
    summed per-row bytes fit, the true bytes do not, until the splitter re-weights."""
    n = 24
    costs = typed_costs(n, 6)
    shapes = shapes_of(n, 6)
    length = np.where(np.arange(n) % 4 == 0, 10.0, 1.0)
    budget = MemoryBudget(30.0, length, lambda rows: float(len(rows) * length[list(rows)].max()))
    result = make_splitter("dflop").split(SplitRequest.of_positions(costs, shapes, 3, 2, sync="module", memory=budget))
    for rank in result.ranks:
        for mb in rank:
            assert len(mb) < 2 or len(mb) * length[mb].max() <= 30.0


def test_an_oversize_row_is_named_unless_allowed():
    costs = typed_costs(8, 7)
    shapes = shapes_of(8, 7)
    rows = np.ones(8)
    rows[5] = 50.0
    request = SplitRequest([10 + i for i in range(8)], costs, 2, 2, shapes=shapes, memory=MemoryBudget(4.0, rows))
    with pytest.raises(ValueError, match="sample 15"):
        make_splitter("dflop").split(request)
    allowed = SplitRequest(
        [10 + i for i in range(8)], costs, 2, 2, shapes=shapes, memory=MemoryBudget(4.0, rows, allow_oversize=True)
    )
    assert [15] in [mb for rank in make_splitter("dflop").split(allowed).ranks for mb in rank]
