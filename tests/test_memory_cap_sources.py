"""Where the memory cap comes from (the plan, the config, the device) and its per-stage share."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from deepspeed.accelerator import get_accelerator
from test_plan_config import tiny_cost_model
from test_planner import POOL
from test_sampler_memory_cap import clip, planted, sampler, trained
from tiny_plans import one_stage_plan, two_stage_plan

from dflop_ds.compose import sampler_memory_cap
from dflop_ds.config import DFLOPConfig, fill_from_plan, get_setting, plan_deepspeed_config, set_settings
from dflop_ds.cost import LLMOnlyCost, PackedCost, ProxyCost, StageCost, memory_blind_model
from dflop_ds.cost.stage import in_flight_microbatches, stage_memory_caps
from dflop_ds.models.source import tiny_source
from dflop_ds.plan import Cluster, Plan, make_plans
from dflop_ds.plan.planner import activation_budget
from dflop_ds.schedule.memory import OversizeSampleError, microbatch_bytes, sample_bytes
from dflop_ds.train.memory_cap import (
    DEFAULT_MEMORY_MARGIN,
    RunMemoryCap,
    device_activation_budget,
    device_memory_cap,
    rank_state_bytes,
    resolve_memory_cap,
)

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "examples" / "data" / "mixture.jsonl"
SHARES = np.array([[0.9, 0.2], [0.1, 0.8]])  # stage 0: most of the encoder; stage 1: most of the LLM


def never() -> RunMemoryCap:
    """A device default that must not be asked for."""
    raise AssertionError("the device is not asked")


# -- the stage share ----------------------------------------------------------------------------------
def test_under_1f1b_stage_s_holds_p_minus_s_microbatches_and_its_cap_is_the_budget_over_them():
    assert in_flight_microbatches(4).tolist() == [4, 3, 2, 1]
    assert in_flight_microbatches(4, microbatches=2).tolist() == [2, 2, 2, 1]  # never more than the step has
    assert stage_memory_caps(12.0, 3, microbatches=8).tolist() == [4.0, 6.0, 12.0]
    assert stage_memory_caps(12.0, 1).tolist() == [12.0]
    with pytest.raises(ValueError, match="microbatches >= 1"):
        in_flight_microbatches(2, microbatches=0)


def test_stage_memory_is_each_stages_share_times_its_microbatches_in_flight():
    cost = ProxyCost(tile_cost=1.0)
    staged = StageCost(cost, SHARES, microbatches=4)
    shapes = [clip("v", 48, 200), clip("t", 0, 90)]
    columns = cost.predict_memory(shapes)
    per_stage = staged.predict_memory(shapes)
    assert np.allclose(per_stage, [2 * SHARES[0] @ columns, 1 * SHARES[1] @ columns])
    # the cap bounds each stage's device, not the sum of the devices
    assert microbatch_bytes(staged, shapes) == pytest.approx(per_stage.max())
    assert microbatch_bytes(cost, shapes) == pytest.approx(columns.sum())
    # entry s under a budget B is the stage's share under stage_memory_caps(B)[s]
    budget = float(per_stage.max())
    caps = stage_memory_caps(budget, 2, 4)
    assert np.all(SHARES @ columns <= caps + 1e-6)


def test_a_stage_holding_two_microbatches_refuses_a_video_the_whole_model_bytes_would_admit():
    shapes = planted(64, long_videos=3)
    cost = ProxyCost(tile_cost=1.0)
    staged = StageCost(cost, SHARES, microbatches=4)
    whole, per_stage = float(sample_bytes(cost, shapes).max()), float(sample_bytes(staged, shapes).max())
    assert per_stage > whole, "stage 0 keeps 2 microbatches of 90% of the encoder's bytes"
    budget = (whole + per_stage) / 2
    sampler(shapes, cost, memory_cap=budget)  # whole-model bytes of one microbatch fit
    with pytest.raises(OversizeSampleError, match="'video"):
        sampler(shapes, staged, memory_cap=budget)


def test_planted_long_videos_keep_every_stage_under_its_cap():
    shapes = planted(96, long_videos=10)
    cost = ProxyCost(tile_cost=1.0)
    staged = StageCost(cost, SHARES, microbatches=4)
    budget = 1.3 * float(sample_bytes(staged, shapes).max())
    free = trained(sampler(shapes, staged))
    assert max(microbatch_bytes(staged, [shapes[i] for i in mb]) for rank in free for mb in rank) > budget
    capped = trained(sampler(shapes, staged, memory_cap=budget))
    caps = stage_memory_caps(budget, 2, 4)
    for mb in (mb for rank in capped for mb in rank):
        share = SHARES @ cost.predict_memory([shapes[i] for i in mb])
        assert np.all(share <= caps * (1 + 1e-9)), (mb, share, caps)


def test_without_per_stage_predictions_a_pipeline_compares_whole_bytes_with_the_smallest_stage_cap():
    cap = RunMemoryCap(8e9, "config")
    assert sampler_memory_cap(cap, ProxyCost(), num_stages=2, microbatches=4) == 4e9
    assert sampler_memory_cap(cap, ProxyCost(), num_stages=1, microbatches=4) == 8e9
    assert sampler_memory_cap(cap, StageCost(ProxyCost(), SHARES, 4), num_stages=2, microbatches=4) == 8e9
    assert sampler_memory_cap(RunMemoryCap(None, "off"), ProxyCost(), num_stages=2, microbatches=4) is None


# -- the plan sets the cap ------------------------------------------------------------------------------
def test_a_plan_records_the_activation_budget_its_memory_model_left():
    cluster = Cluster(gpus=4, gpu_memory_bytes=16e9, memory_reserve_bytes=2e9)
    plans = make_plans(tiny_cost_model(), cluster, POOL, 16, n_batches=1, top_k=2)
    for plan, scored in ((plans.best_deepspeed, plans.result.best_deepspeed), (plans.best, plans.result.best)):
        states = max(float(e.states.max()) for e in scored.evaluations)
        assert 0 < states < cluster.usable_memory
        assert plan.memory_cap_bytes == pytest.approx(cluster.usable_memory - states)
        assert plan.memory_cap_bytes == activation_budget(scored, cluster)
        # the plan's own microbatches fit: states + activations of every stage within the usable memory
        assert float(np.max(scored.memory)) - states <= plan.memory_cap_bytes * (1 + 1e-9)


def test_plan_files_keep_the_cap_and_older_files_without_it_still_load(tmp_path: Path):
    plan = two_stage_plan(zero_stage=1, memory_cap_bytes=3e9)
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json").memory_cap_bytes == 3e9
    old = json.loads((tmp_path / "plan.json").read_text())
    del old["memory_cap_bytes"]  # a file written before plans recorded the cap
    (tmp_path / "old.json").write_text(json.dumps(old))
    loaded = Plan.load(tmp_path / "old.json")
    assert loaded.memory_cap_bytes is None and "memory_cap_bytes" not in loaded.dflop_settings()
    old["memory_cap_bytes"] = "3GB"
    (tmp_path / "bad.json").write_text(json.dumps(old))
    with pytest.raises(ValueError, match="bad.json: bad value: memory_cap_bytes must be a positive number"):
        Plan.load(tmp_path / "bad.json")


def test_the_plans_cap_fills_the_config_unless_the_config_sets_one():
    plan = one_stage_plan(memory_cap_bytes=3e9)
    assert DFLOPConfig.from_dict(plan_deepspeed_config(plan)["dflop"]).sampler.memory_cap_bytes == 3e9
    for block in ({}, set_settings({}, memory_cap_bytes="auto")):
        _, filled = fill_from_plan({}, block, plan)
        assert get_setting(filled, "memory_cap_bytes") == 3e9
    for mine in (1e9, "off"):  # the config wins
        _, filled = fill_from_plan({}, set_settings({}, memory_cap_bytes=mine), plan)
        assert get_setting(filled, "memory_cap_bytes") == mine
    _, filled = fill_from_plan({}, set_settings({}, sampler="stock"), plan)  # a sampler that takes no cap
    assert get_setting(filled, "memory_cap_bytes") is None
    stock_plan = one_stage_plan(memory_cap_bytes=3e9)
    stock_plan.splitter = "stock"
    assert "memory_cap_bytes" not in stock_plan.dflop_settings()


def test_planted_long_videos_against_a_plan_given_cap():
    shapes = planted(96, long_videos=10)
    cost = ProxyCost(tile_cost=1.0)
    video = float(sample_bytes(cost, shapes).max())
    plan = one_stage_plan(memory_cap_bytes=1.4 * video)
    _, block = fill_from_plan({}, {}, plan)
    cap = resolve_memory_cap(DFLOPConfig.from_dict(block).sampler.memory_cap_bytes, "dflop", True, never)
    assert cap == RunMemoryCap(1.4 * video, "plan")
    capped = trained(sampler(shapes, cost, memory_cap=cap.bytes))
    assert max(microbatch_bytes(cost, [shapes[i] for i in mb]) for rank in capped for mb in rank) <= cap.bytes
    # the config's own cap wins: below one video alone, the video is refused by name
    _, block = fill_from_plan({}, set_settings({}, memory_cap_bytes=0.5 * video), plan)
    mine = resolve_memory_cap(DFLOPConfig.from_dict(block).sampler.memory_cap_bytes, "dflop", False, never)
    assert mine == RunMemoryCap(0.5 * video, "config")
    with pytest.raises(OversizeSampleError, match="'video"):
        sampler(shapes, cost, memory_cap=mine.bytes)


# -- the device default -----------------------------------------------------------------------------------
def test_the_device_budget_is_the_free_share_plus_what_the_rank_holds_less_its_model_states():
    assert device_activation_budget(free=10e9, held=1e9, states=2e9, sharing=2, margin=0.2) == pytest.approx(3.2e9)
    assert device_activation_budget(free=1e9, held=0.0, states=2e9) == 0.0
    with pytest.raises(ValueError, match="sharing >= 1"):
        device_activation_budget(1e9, 0.0, 0.0, sharing=0)


def test_model_states_follow_the_zero_stage_precision_and_frozen_weights():
    module = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 10))  # 2 x 110 fp32 params
    module[1].requires_grad_(False)
    weights = 110 * 4.0
    assert rank_state_bytes(module, "fp32", 0, dp=1) == pytest.approx(weights * 4 + weights)
    assert rank_state_bytes(module, "fp32", 1, dp=2) == pytest.approx(weights * (2 + 2 / 2) + weights)
    assert rank_state_bytes(module, "fp32", 3, dp=2) == pytest.approx(weights * 4 / 2 + weights / 2)


def patched_accelerator(monkeypatch, available: float, allocated: float = 0.0):
    accelerator = get_accelerator()
    monkeypatch.setattr(accelerator, "available_memory", lambda device_index=None: available)
    monkeypatch.setattr(accelerator, "memory_allocated", lambda device_index=None: allocated)
    return accelerator


def test_planted_long_videos_against_the_device_default(monkeypatch):
    shapes = planted(96, long_videos=10)
    cost = ProxyCost(tile_cost=1.0)
    video = float(sample_bytes(cost, shapes).max())
    module = torch.nn.Linear(64, 64)
    config = {"zero_optimization": {"stage": 0}}
    states = rank_state_bytes(module, "fp32", 0, 1)
    free = 1.5 * video / (1 - DEFAULT_MEMORY_MARGIN) + states
    accelerator = patched_accelerator(monkeypatch, available=free)
    cap = resolve_memory_cap("auto", "dflop", False, lambda: device_memory_cap(module, config, 1, accelerator))
    assert cap.source == "device" and cap.bytes == pytest.approx(1.5 * video)
    assert "GB available on" in cap.describe()
    capped = trained(sampler(shapes, cost, memory_cap=cap.bytes))
    assert max(microbatch_bytes(cost, [shapes[i] for i in mb]) for rank in capped for mb in rank) <= cap.bytes
    # a device with less free memory than one video needs: the video is refused by name
    accelerator = patched_accelerator(monkeypatch, available=0.5 * video + states)
    small = device_memory_cap(module, config, 1, accelerator)
    with pytest.raises(OversizeSampleError, match="'video.*memory_cap_bytes"):
        sampler(shapes, cost, memory_cap=small.bytes)
    accelerator = patched_accelerator(monkeypatch, available=0.5 * states)
    with pytest.raises(ValueError, match="leaves no memory for activations.*set a number of bytes or 'off'"):
        device_memory_cap(module, config, 1, accelerator)


def test_the_device_default_never_refuses_the_bundled_data():
    source = tiny_source({}, policy_name="tiny", seed=0)
    shapes = source.read_shapes(str(DATA), "error")[:]
    encoder, projector, llm = source.layers()
    module = torch.nn.ModuleList([spec.build() for spec in (*encoder, projector, *llm)])
    cap = device_memory_cap(module, {}, 1, get_accelerator())
    assert cap.bytes is not None
    assert float(sample_bytes(ProxyCost(), shapes).max()) < cap.bytes / 10


def test_off_and_other_samplers_have_no_cap_and_the_setting_is_typed():
    assert resolve_memory_cap("off", "dflop", False, never) == RunMemoryCap(None, "off")
    assert resolve_memory_cap("auto", "stock", False, never).bytes is None
    assert resolve_memory_cap(2e9, "dflop", False, never) == RunMemoryCap(2e9, "config")
    # a colocated encoder's sampler balances LLMOnlyCost, which predicts no memory: "auto" is no cap,
    # a number is refused by the sampler naming the model
    blind = memory_blind_model(PackedCost(LLMOnlyCost(ProxyCost())))
    assert isinstance(blind, LLMOnlyCost) and memory_blind_model(PackedCost(ProxyCost())) is None
    assert resolve_memory_cap("auto", "dflop", False, never, blind) == RunMemoryCap(
        None, "LLMOnlyCost predicts no memory"
    )
    with pytest.raises(ValueError, match="predicts memory.*LLMOnlyCost does not"):
        sampler(planted(32, 1), PackedCost(LLMOnlyCost(ProxyCost())), memory_cap=1e9)
    for good in ("auto", "off", 1, 2.5e9):
        assert DFLOPConfig.from_dict({"sampler": {"memory_cap_bytes": good}}).sampler.memory_cap_bytes == good
    for bad in ("2GB", None, True, -1):
        with pytest.raises(ValueError, match="dflop.sampler.memory_cap_bytes must be"):
            DFLOPConfig.from_dict({"sampler": {"memory_cap_bytes": bad}})
