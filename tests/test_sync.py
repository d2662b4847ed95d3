"""The sync model: derived from a DeepSpeed config, and a split's step cost under each model."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from dflop_ds.sync import SyncModel, as_sync_model, step_cost, step_lower_bound, sync_model_of


@pytest.mark.parametrize(
    ("config", "stages", "layer", "expected"),
    [
        ({}, 1, None, SyncModel.BOUNDARY),
        ({"zero_optimization": {"stage": 1}}, 1, None, SyncModel.BOUNDARY),
        ({"zero_optimization": {"stage": 2}}, 1, None, SyncModel.MODULE),
        ({"zero_optimization": {"stage": 2}}, 1, 1000, SyncModel.MICROSTEP),
        ({"zero_optimization": {"stage": 2, "reduce_bucket_size": 500}}, 1, 1000, SyncModel.MODULE),
        ({"zero_optimization": {"stage": 3}}, 1, 1000, SyncModel.MODULE),
        ({"zero_optimization": {"stage": 1}}, 2, None, SyncModel.PIPELINE),
    ],
)
def test_sync_model_of_config(config, stages, layer, expected):
    assert sync_model_of(config, stages, layer) is expected


def test_step_cost_per_model():
    # rank 0: heavy then light; rank 1: light then heavy (misaligned), columns (encoder, llm)
    t = np.array([[[3.0, 1.0], [0.5, 0.5]], [[0.5, 0.5], [1.0, 3.0]]])
    assert step_cost(t, "boundary") == pytest.approx(5.0)
    assert step_cost(t, "microstep") == pytest.approx(4.0 + 4.0)
    assert step_cost(t, "module") == pytest.approx((3.0 + 1.0) + (1.0 + 3.0))
    aligned = np.array([[[3.0, 1.0], [0.5, 0.5]], [[1.0, 3.0], [0.5, 0.5]]])
    assert step_cost(aligned, "microstep") == pytest.approx(5.0)
    assert step_cost(aligned, "module") == pytest.approx(3.0 + 3.0 + 1.0)  # crossed columns still wait
    with pytest.raises(ValueError, match="simulate"):
        step_cost(t, SyncModel.PIPELINE)


def test_lower_bound_holds_for_random_splits():
    rng = np.random.default_rng(0)
    for _ in range(200):
        dp, n_mb = int(rng.integers(1, 5)), int(rng.integers(1, 4))
        n = dp * n_mb + int(rng.integers(0, 6))
        costs = rng.exponential(size=(n, 2))
        labels = np.concatenate([np.arange(dp * n_mb), rng.integers(0, dp * n_mb, n - dp * n_mb)])
        rng.shuffle(labels)
        times = np.zeros((dp * n_mb, 2))
        np.add.at(times, labels, costs)
        times = times.reshape(dp, n_mb, 2)
        for sync in ("boundary", "microstep", "module"):
            assert step_cost(times, sync) >= step_lower_bound(costs, dp, n_mb, sync) - 1e-9


def test_unknown_name_lists_the_models():
    with pytest.raises(ValueError, match="boundary"):
        as_sync_model("zero9")


def _optimum(costs: np.ndarray, dp: int, n_mb: int, sync: str) -> float:
    """The smallest step of any split, by enumerating every labelling (tiny instances only)."""
    n, m = costs.shape[0], dp * n_mb
    best = np.inf
    for labels in itertools.product(range(m), repeat=n):
        if len(set(labels)) < m:
            continue
        times = np.zeros((m, costs.shape[1]))
        np.add.at(times, list(labels), costs)
        best = min(best, step_cost(times.reshape(dp, n_mb, -1), sync))
    return best


def test_granularity_bound_never_exceeds_the_brute_force_optimum():
    rng = np.random.default_rng(7)
    tighter = 0
    for _ in range(60):
        dp, n_mb = int(rng.integers(1, 3)), int(rng.integers(1, 3))
        n = dp * n_mb + int(rng.integers(0, 3))
        costs = rng.exponential(size=(n, 2)) * (rng.random((n, 2)) < 0.7)  # zeros, as text has no encoder
        for sync in ("boundary", "microstep", "module"):
            bound, best = step_lower_bound(costs, dp, n_mb, sync), _optimum(costs, dp, n_mb, sync)
            assert bound <= best + 1e-9, (sync, costs, dp, n_mb)
            tighter += bound > costs.sum() / dp + 1e-9
    assert tighter > 0  # the granularity terms do bind above the average
