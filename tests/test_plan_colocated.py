"""The planner's colocated family: encoder data-parallel over every GPU, LLM pipeline over its own layers."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_plan_file import _shapes as plan_file_shapes

from dflop_ds.config import fill_from_plan, get_setting, plan_deepspeed_config, set_settings
from dflop_ds.cost import reference_model
from dflop_ds.plan import Cluster, Plan, Segment, make_plans, search
from dflop_ds.plan.families import COLOCATED, DEEPSPEED, family_of
from dflop_ds.plan.families.colocated import evaluate_colocated, projector_share
from dflop_ds.plan.layout import Layout, flat_bounds
from dflop_ds.plan.simulator import simulate_1f1b, simulate_colocated

SHAPES = plan_file_shapes(160)  # videos, images and text: a skewed encoder load


@pytest.fixture(scope="module")
def result():
    return search(reference_model("llava-ov-7b-h100"), Cluster(gpus=16), SHAPES, 64, n_batches=2, top_k=3)


def test_colocated_layouts_put_the_encoder_on_every_gpu_and_split_only_llm_layers(result) -> None:
    model = reference_model("llava-ov-7b-h100")
    colocated = [s for s in result.candidates if s.family == "colocated"]
    assert colocated and result.best_colocated is not None
    for s in colocated:
        layout = s.layout
        assert layout.colocated and layout.deepspeed_compatible
        assert layout.encoder == Segment(1, 1, 16)
        assert layout.n_stages * layout.llm.tp * layout.llm.dp == layout.gpus == 16
        assert layout.llm.pp == layout.n_stages
        # the encoder layers sit on stage 0 of the flat list, every stage holds LLM layers
        assert layout.stages[0][:2] == (model.encoder_layers, 1)
        assert all(st[0] == 0 for st in layout.stages[1:]) and all(st[2] > 0 for st in layout.stages)
        assert 64 % (layout.llm.dp * layout.n_mb) == 0
        assert s.memory.max() <= Cluster(gpus=16).usable_memory or not s.feasible
    assert result.best.step_time == min(result.best_deepspeed.step_time, result.best_colocated.step_time)


def test_colocated_plan_writes_the_colocated_encoder_key(tmp_path) -> None:
    plans = make_plans(
        reference_model("llava-ov-0.5b-h100"), Cluster(gpus=8, max_tp=1), SHAPES, 64, n_batches=1, top_k=2
    )
    plan = plans.colocated
    assert plan is not None and plan.family == "colocated" and plan.layout.colocated
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = Plan.load(path)
    assert loaded == plan and loaded.layout == plan.layout
    cfg = plan_deepspeed_config(loaded)
    assert get_setting(cfg["dflop"], "encoder") == "colocated"
    assert get_setting(cfg["dflop"], "pipeline_stages") == plan.pipeline_stages
    assert get_setting(cfg["dflop"], "stage_bounds") == flat_bounds(plan.stages)
    assert cfg["train_batch_size"] == 64 and loaded.world_size() == 8
    assert get_setting(plan_deepspeed_config(plans.best_deepspeed)["dflop"], "encoder") is None
    # a dflop.plan.file entry turns the colocated encoder on in the training config
    _, block = fill_from_plan({}, set_settings({}, plan=str(path)), loaded)
    assert get_setting(block, "encoder") == "colocated"
    assert get_setting(block, "pipeline_stages") == plan.pipeline_stages
    assert json.loads(path.read_text())["family"] == "colocated"


def test_simulate_colocated_adds_the_encoder_phases_around_the_pipeline() -> None:
    rng = np.random.default_rng(0)
    fwd, bwd = rng.uniform(0.5, 1.5, (2, 4, 3)), rng.uniform(1.0, 3.0, (2, 4, 3))
    pipe = simulate_1f1b(fwd, bwd, act_comm=0.05, allreduce=[0.1, 0.2, 0.1])
    sim = simulate_colocated(
        fwd,
        bwd,
        encoder_fwd=0.7,
        encoder_bwd=1.4,
        exchange=0.3,
        act_comm=0.05,
        allreduce=[0.1, 0.2, 0.1],
        encoder_allreduce=0.25,
    )
    assert sim.step_time == pytest.approx(0.7 + 0.3 + pipe.step_time + 0.3 + 1.4 + 0.25)
    np.testing.assert_allclose(sim.f_start, pipe.f_start + 1.0)
    np.testing.assert_allclose(sim.busy, pipe.busy + 2.1)
    assert sim.phases["encoder_forward_s"] == 0.7 and np.all(sim.rank_step_times == sim.step_time)


def test_colocated_evaluation_spreads_the_encoder_over_every_gpu() -> None:
    model = reference_model("llava-ov-7b-h100")
    shapes = SHAPES[:64]
    costs = np.asarray(model.predict_samples(shapes), dtype=float)
    stages = ((model.encoder_layers, 1, model.llm_layers),)

    def encoder_phase(gpus: int, gpus_per_node: int) -> tuple[float, float]:
        cluster = Cluster(gpus=gpus, gpus_per_node=gpus_per_node)
        layout = Layout(Segment(1, 1, gpus), Segment(1, 1, gpus), 64 // gpus, stages, colocated=True)
        phases = evaluate_colocated(model, cluster, layout, shapes, costs).sim.phases
        return phases["encoder_forward_s"] + phases["encoder_backward_s"], phases["exchange_s"]

    enc8, x_intra = encoder_phase(8, 8)
    enc16, x_inter = encoder_phase(16, 8)
    # the batch's encoder seconds (less the projector's, on the LLM) over the GPUs, or more when a
    # micro-step's heaviest tile is longer
    floor = costs[:, 0].sum() * (1 - projector_share(model))
    assert floor / 8 <= enc8 * (1 + 1e-9) and floor / 16 <= enc16 * (1 + 1e-9)
    assert enc16 < enc8
    # leaving the node costs the inter-node bandwidth
    assert x_inter > x_intra > 0


def test_family_of_routes_layouts_to_their_evaluation() -> None:
    stages = ((27, 1, 28),)
    assert family_of(Layout(Segment(1, 1, 8), Segment(1, 1, 8), 2, stages, colocated=True)) is COLOCATED
    assert family_of(Layout(Segment(1, 1, 8), Segment(1, 1, 8), 2, stages)) is DEEPSPEED


def test_cluster_terms_are_elementwise_over_arrays() -> None:
    cluster = Cluster(gpus=64)
    tp, dp = np.array([1, 2, 4, 8]), np.array([1, 3, 8, 16])
    nbytes = np.array([0.0, 1e9, 2e9, 3e9])
    np.testing.assert_allclose(cluster.tp_speedup(tp), [cluster.tp_speedup(int(t)) for t in tp])
    np.testing.assert_allclose(cluster.state_factor(dp), [cluster.state_factor(int(d)) for d in dp])
    np.testing.assert_allclose(
        cluster.allreduce_seconds(nbytes, dp, tp),
        [cluster.allreduce_seconds(float(b), int(d), int(t)) for b, d, t in zip(nbytes, dp, tp)],
    )
    assert cluster.allreduce_seconds(1e9, 1, 8) == 0.0 and isinstance(cluster.tp_speedup(2), float)
    assert cluster.allreduce_seconds(1e9, 2, 4) < cluster.allreduce_seconds(1e9, 4, 4)  # 16 ranks leave the node


@pytest.mark.slow
def test_a_colocated_plan_trains_on_two_ranks_with_zero2(colocated_plan_run) -> None:
    summary = colocated_plan_run["run"]["summary"]
    assert summary["engine"] == "plain" and summary["train_batch_size"] == 16
    assert summary["gradient_accumulation_steps"] == 4 and summary["zero_stage"] == 2
