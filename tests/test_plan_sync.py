"""Single-stage (pp = 1) layouts scored under the synchronisation model of the cluster's ZeRO stage."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from dflop_ds.cost import reference_model
from dflop_ds.plan import Cluster
from dflop_ds.plan.evaluate import _stats, evaluate, forward_fraction
from dflop_ds.plan.layout import Layout, Segment, stages_from_bounds
from dflop_ds.plan.simulator import simulate_1f1b, simulate_synchronised
from dflop_ds.shapes import ShapePolicy
from dflop_ds.sync import SyncModel, step_cost

MODEL = reference_model("llava-ov-0.5b-h100")


def _batch(n: int = 32, seed: int = 0) -> list:
    """Images, videos and text of varied lengths (the default policy)."""
    rng = np.random.default_rng(seed)
    policy = ShapePolicy()
    shapes = []
    for i in range(n):
        text = int(rng.integers(20, 1200))
        kind = i % 3
        if kind == 0:
            shapes.append(policy.shape(f"t{i}", text_tokens=text))
        elif kind == 1:
            size = (int(rng.integers(200, 1600)), int(rng.integers(200, 1600)))
            shapes.append(policy.shape(f"i{i}", image_sizes=[size], text_tokens=text))
        else:
            shapes.append(policy.shape(f"v{i}", video_frames=int(rng.integers(8, 64)), text_tokens=text))
    return shapes


def _single_stage(dp: int, n_mb: int, splitter: str) -> Layout:
    E, L = MODEL.encoder_layers, MODEL.llm_layers
    stages = stages_from_bounds([0, E + 1 + L], E, 1, L)
    return Layout(Segment(1, 1, dp), Segment(1, 1, dp), n_mb, stages, splitter=splitter)


@pytest.mark.parametrize(
    ("zero_stage", "module_buckets", "expected"),
    [
        (0, True, SyncModel.BOUNDARY),
        (1, True, SyncModel.BOUNDARY),
        (2, True, SyncModel.MODULE),
        (2, False, SyncModel.MICROSTEP),
        (3, True, SyncModel.MODULE),
    ],
)
def test_the_cluster_derives_its_sync_model_from_its_zero_stage(zero_stage, module_buckets, expected) -> None:
    cluster = Cluster(gpus=8, zero_stage=zero_stage, module_buckets=module_buckets)
    assert cluster.sync_model() is expected
    assert cluster.sync_model(pipeline_stages=2) is SyncModel.PIPELINE


@pytest.mark.parametrize("sync", [SyncModel.BOUNDARY, SyncModel.MICROSTEP, SyncModel.MODULE])
def test_a_synchronised_step_is_the_sync_models_step_cost_plus_the_reduction(sync) -> None:
    times = np.random.default_rng(1).uniform(0.1, 2.0, size=(4, 5, 2))
    sim = simulate_synchronised(times, sync, forward_fraction=0.25, allreduce=0.3)
    assert sim.step_time == pytest.approx(step_cost(times, sync) + 0.3)
    assert sim.busy[:, 0] == pytest.approx(times.sum(axis=(1, 2)))
    assert np.all(sim.idle >= -1e-12)
    # the microbatches run one after the other, each forward before its backward
    assert np.all(np.diff(sim.f_start[..., 0], axis=1) > 0)
    assert np.all(sim.b_end >= sim.f_end)


def test_at_the_boundary_a_single_stage_is_what_the_1f1b_simulator_gives() -> None:
    times = np.random.default_rng(2).uniform(0.1, 2.0, size=(3, 4, 2))
    total = times.sum(axis=2)[..., None]
    pipe = simulate_1f1b(total * 0.25, total * 0.75, allreduce=np.array([0.2]))
    sync = simulate_synchronised(times, SyncModel.BOUNDARY, forward_fraction=0.25, allreduce=np.array([0.2]))
    assert sync.step_time == pytest.approx(pipe.step_time)
    assert sync.rank_step_times == pytest.approx(pipe.rank_step_times)
    assert sync.f_end == pytest.approx(pipe.f_end)
    assert sync.b_end == pytest.approx(pipe.b_end)


def test_misaligned_ranks_cost_more_when_they_meet_every_microbatch() -> None:
    heavy_light = np.array([[[3.0, 0.0], [0.0, 1.0]], [[0.0, 1.0], [3.0, 0.0]]])  # opposite orders
    steps = {
        s: simulate_synchronised(heavy_light, s, forward_fraction=0.25).step_time for s in SyncModel if not s.pipelined
    }
    assert steps[SyncModel.BOUNDARY] == pytest.approx(4.0)
    assert steps[SyncModel.MICROSTEP] == pytest.approx(6.0)
    assert steps[SyncModel.MODULE] == pytest.approx(8.0)


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
@pytest.mark.parametrize("splitter", ["stock", "dflop"])
def test_evaluate_scores_a_single_stage_under_the_clusters_sync_model(zero_stage, splitter) -> None:
    shapes = _batch()
    costs = MODEL.predict_samples(shapes)
    cluster = Cluster(gpus=4, zero_stage=zero_stage)
    layout = _single_stage(4, 2, splitter)
    result = evaluate(MODEL, cluster, layout, shapes, costs, fast=False)
    times = _stats(MODEL, shapes, result.order).time
    sim = result.sim
    reduction = float(sim.allreduce.max())
    assert reduction > 0
    assert sim.step_time == pytest.approx(step_cost(times, cluster.sync_model()) + reduction)
    assert forward_fraction(MODEL) == 0.25


def test_the_dflop_split_of_a_single_stage_is_made_for_the_sync_model() -> None:
    """Under ZeRO-3 DFLOP's split meets in lockstep: no worse than its ZeRO-1 split scored under ZeRO-3."""
    shapes = _batch(48, seed=3)
    costs = MODEL.predict_samples(shapes)
    layout = _single_stage(4, 3, "dflop")
    zero3 = Cluster(gpus=4, zero_stage=3)
    for fast in (True, False):
        for_zero3 = evaluate(MODEL, zero3, layout, shapes, costs, fast=fast)
        for_zero1 = evaluate(MODEL, replace(zero3, zero_stage=1), layout, shapes, costs, fast=fast)
        scored_under_zero3 = step_cost(_stats(MODEL, shapes, for_zero1.order).time, SyncModel.MODULE)
        assert for_zero3.sim.step_time - float(for_zero3.sim.allreduce.max()) <= scored_under_zero3 + 1e-12


def test_a_colocated_single_llm_stage_meets_as_the_sync_model_says() -> None:
    from dflop_ds.plan.simulator import simulate_colocated

    total = np.random.default_rng(4).uniform(0.1, 1.0, size=(3, 4, 1))
    phases = {"encoder_fwd": 0.5, "encoder_bwd": 1.0, "exchange": 0.1, "allreduce": 0.2, "encoder_allreduce": 0.3}
    steps = {
        sync: simulate_colocated(total * 0.25, total * 0.75, **phases, sync=sync).step_time
        for sync in (SyncModel.PIPELINE, SyncModel.BOUNDARY, SyncModel.MODULE)
    }
    outside = 0.5 + 1.0 + 2 * 0.1 + 0.2 + 0.3
    assert steps[SyncModel.PIPELINE] == pytest.approx(steps[SyncModel.BOUNDARY])
    assert steps[SyncModel.BOUNDARY] == pytest.approx(outside + step_cost(total, SyncModel.BOUNDARY))
    assert steps[SyncModel.MODULE] == pytest.approx(outside + step_cost(total, SyncModel.MODULE))
    assert steps[SyncModel.MODULE] > steps[SyncModel.BOUNDARY]


@pytest.mark.parametrize(("zero_stage", "expected"), [(1, "boundary"), (3, "module")])
def test_a_plan_records_the_sync_model_it_was_scored_under(zero_stage, expected) -> None:
    from dflop_ds.plan import make_plans

    shapes = _batch(64, seed=5)
    plans = make_plans(MODEL, Cluster(gpus=4, zero_stage=zero_stage, max_tp=1), shapes, 16, n_batches=1)
    for plan in (plans.best, plans.best_deepspeed):
        pipelined = plan.layout.n_stages > 1
        assert plan.predicted["sync_model"] == ("pipeline" if pipelined else expected)


def test_the_planners_boundary_split_is_the_dflop_splitters_boundary_split() -> None:
    """split_batch hands the splitter the summed column at the boundary (cheaper): the same split
    as asking it for ``sync=boundary`` on both columns with their true microbatch costs."""
    from dflop_ds.plan.evaluate import split_batch
    from dflop_ds.schedule.splitters import SplitRequest, make_splitter

    shapes = _batch(96, seed=6)
    costs = MODEL.predict_samples(shapes)
    layout = _single_stage(8, 3, "dflop")
    cluster = Cluster(gpus=8, zero_stage=1)
    planned = split_batch(layout, shapes, costs, fast=False, seed=0, cluster=cluster, model=MODEL)

    def true_cost(items):
        return np.asarray(MODEL.predict_microbatch([shapes[i] for i in items]), dtype=float)

    request = SplitRequest.of_positions(costs, shapes, 3, 8, microbatch_cost=true_cost, seed=0, sync="boundary")
    assert planned == make_splitter("dflop").split(request).ranks


@pytest.mark.parametrize("summed", [False, True])
def test_one_sample_microbatches_are_the_per_microbatch_predictions(summed) -> None:
    """The batched times of every sample alone are exactly what microbatch_seconds would
    remember for it (the splitter then reads them instead of predicting each)."""
    from dflop_ds.cost import SampleColumns
    from dflop_ds.plan.evaluate import microbatch_seconds, one_sample_microbatches

    shapes = _batch(64, seed=9)
    scale = np.array([0.37, 0.011])
    known = one_sample_microbatches(MODEL, SampleColumns.of(shapes), scale, summed)
    assert sorted(known) == [(i,) for i in range(len(shapes))]
    for i in range(len(shapes)):
        expected = microbatch_seconds(MODEL, shapes, [i], {}, scale, summed)
        assert known[(i,)].tolist() == expected.tolist()  # bit for bit


def test_the_one_sample_per_microbatch_split_is_the_dflop_splitters() -> None:
    """With one sample per microbatch split_batch hands the splitter batched times: the same split
    as the splitter timing every microbatch itself."""
    from dflop_ds.plan.evaluate import split_batch
    from dflop_ds.schedule.splitters import SplitRequest, make_splitter

    shapes = _batch(48, seed=4)
    costs = MODEL.predict_samples(shapes)
    for zero_stage, sync in ((1, "boundary"), (3, "module")):
        cluster = Cluster(gpus=16, zero_stage=zero_stage)
        planned = split_batch(
            _single_stage(16, 3, "dflop"), shapes, costs, fast=False, seed=0, cluster=cluster, model=MODEL
        )

        def true_cost(items):  # a single stage at tp 1: the costs unscaled
            return np.asarray(MODEL.predict_microbatch([shapes[i] for i in items]), dtype=float)

        request = SplitRequest.of_positions(costs, shapes, 3, 16, microbatch_cost=true_cost, seed=0, sync=sync)
        assert planned == make_splitter("dflop").split(request).ranks
