"""check_training_setup: an inconsistent DeepSpeed config / "dflop" block / plan / dataset is refused
before training, with the key at fault named."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflop_ds.config import DFLOPConfig, fill_from_plan, get_setting, plan_deepspeed_config, set_settings
from dflop_ds.plan import Plan
from dflop_ds.plan.layout import Layout, Segment
from dflop_ds.profile.cache import CACHE_ENV
from dflop_ds.setup_checks import SetupError, check_cost_model, check_training_setup, resolve_batch_keys

ROOT = Path(__file__).resolve().parent.parent
N_LAYERS = 8  # encoder 3 + projector 1 + LLM 4


def ds(total=32, micro=4, gas=8) -> dict:
    config = {"train_batch_size": total, "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas}
    return {k: v for k, v in config.items() if v is not None}


def plan(dp=1, n_mb=8, global_batch=32, stages=((3, 1, 0), (0, 0, 4)), encoder_dp=None) -> Plan:
    layout = Layout(Segment(1, 1, dp if encoder_dp is None else encoder_dp), Segment(1, 1, dp), n_mb, stages)
    return Plan.from_layout(
        layout,
        layer_counts={"encoder": 3, "projector": 1, "llm": 4},
        global_batch_size=global_batch,
        gpus=len(stages) * dp,
        gpus_per_node=8,
        gpu_memory_bytes=8e9,
        family="deepspeed",
    )


def test_bundled_config_passes():
    config = json.loads((ROOT / "ds_configs" / "tiny_mllm_pp2.json").read_text())
    block = DFLOPConfig.from_dict(config.pop("dflop"))
    check_training_setup(config, block, world_size=2, n_samples=1000)


def test_consistent_setup_with_plan_passes():
    block = DFLOPConfig.from_settings(pipeline_stages=2, stage_bounds=[0, 4, 8])
    check_training_setup(ds(), block, 2, plan=plan(), n_samples=64, n_layers=N_LAYERS)
    check_training_setup(
        ds(64, 4, 8), DFLOPConfig.from_settings(pipeline_stages=2), 4, plan=plan(dp=2, global_batch=64)
    )


def test_plan_deepspeed_config_is_accepted():
    p = plan(dp=2, n_mb=3, global_batch=48)
    config = plan_deepspeed_config(p, {})
    assert config["train_batch_size"] == 48
    block = DFLOPConfig.from_dict(config.pop("dflop"))
    check_training_setup(config, block, 4, plan=p, n_samples=100, n_layers=N_LAYERS)
    p.global_batch_size = 50  # DeepSpeed's batch would be 8 * 3 * 2 = 48: refused, not shrunk
    with pytest.raises(SetupError, match="global_batch_size=50 is not a multiple of dp=2 x n_mb=3 = 6"):
        check_training_setup(config, block, 4, plan=p, n_samples=100, n_layers=N_LAYERS)


@pytest.mark.parametrize("world", [3, 5])
def test_stages_must_divide_world_size(world):
    with pytest.raises(SetupError, match=r"dflop\.plan\.pipeline_stages=2 does not divide the world size"):
        check_training_setup(ds(), DFLOPConfig.from_settings(pipeline_stages=2), world)


def test_batch_identity_is_checked_in_our_terms():
    with pytest.raises(
        SetupError,
        match=r"train_batch_size=32 must equal .*=4 x gradient_accumulation_steps=4"
        r" x data-parallel size 1 \(= 16\)",
    ):
        check_training_setup(ds(32, 4, 4), DFLOPConfig.from_settings(pipeline_stages=2), 2)
    # the same keys are right on 4 ranks (dp = 2)
    check_training_setup(ds(32, 4, 4), DFLOPConfig.from_settings(pipeline_stages=2), 4)


@pytest.mark.parametrize(
    "config, dp, expected",
    [
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (32, 4, 4)),
        ({"train_batch_size": 32, "gradient_accumulation_steps": 4}, 2, (32, 4, 4)),
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, 2, (24, 4, 3)),
        ({"train_batch_size": 8}, 2, (8, 4, 1)),
        ({"train_micro_batch_size_per_gpu": 5}, 3, (15, 5, 1)),
    ],
)
def test_missing_batch_keys_are_derived_like_deepspeed(config, dp, expected):
    assert resolve_batch_keys(config, dp) == expected


@pytest.mark.parametrize(
    "config, key",
    [
        ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, "train_micro_batch_size_per_gpu=4"),
        ({"train_batch_size": 30, "gradient_accumulation_steps": 4}, "gradient_accumulation_steps=4"),
        ({"train_batch_size": 0, "train_micro_batch_size_per_gpu": 4}, "train_batch_size must be a positive"),
        ({"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4}, "train_batch_size=4 is not a multiple"),
        ({"gradient_accumulation_steps": 4}, "give train_batch_size or train_micro_batch_size_per_gpu"),
        ({"train_micro_batch_size_per_gpu": "4"}, "train_micro_batch_size_per_gpu must be a positive integer"),
    ],
)
def test_bad_batch_keys_name_the_key(config, key):
    with pytest.raises(SetupError, match=key):
        resolve_batch_keys(config, 2)


@pytest.mark.parametrize(
    "bounds, message",
    [
        ([0, 4, 4], "not increasing: stage 1 gets no layers"),
        ([0, 6, 5], "not increasing: stage 1 gets no layers"),
        ([1, 4, 8], "must start at layer 0"),
        ([0, 4, 7], "end at layer 7, but the model has 8 layers"),
        ([0, 4, 9], "end at layer 9, but the model has 8 layers"),
    ],
)
def test_bad_stage_bounds_are_named(bounds, message):
    block = DFLOPConfig.from_settings(pipeline_stages=2, stage_bounds=bounds)
    with pytest.raises(SetupError, match=r"dflop\.plan\.stage_bounds .*" + message):
        check_training_setup(ds(), block, 2, n_layers=N_LAYERS)


@pytest.mark.parametrize(
    "kwargs, world, config, key",
    [
        ({"n_mb": 4, "global_batch": 16}, 2, ds(), "gradient_accumulation_steps is 8, but the plan says 4"),
        ({"global_batch": 64}, 2, ds(), "train_micro_batch_size_per_gpu is 4, but the plan says 8"),
        ({"dp": 2, "global_batch": 64}, 2, ds(), "this plan is for 4 GPUs, but the run has world size 2"),
        (
            {"stages": ((3, 1, 0), (0, 0, 2), (0, 0, 2))},
            2,
            ds(),
            "this plan is for 3 GPUs, but the run has world size 2",
        ),
        ({}, 4, ds(), "this plan is for 2 GPUs, but the run has world size 4"),  # not batch arithmetic
        ({"encoder_dp": 2}, 2, ds(), "separate GPU sets"),
    ],
)
def test_plan_disagreeing_with_the_config_is_refused(kwargs, world, config, key):
    with pytest.raises(SetupError, match=key):
        check_training_setup(config, DFLOPConfig.from_settings(pipeline_stages=2), world, plan=plan(**kwargs))


def test_plan_stage_count_and_bounds_must_match():
    three = plan(dp=2, stages=((3, 1, 0), (0, 0, 2), (0, 0, 2)))  # 6 ranks as 3 stages x dp 2
    with pytest.raises(SetupError, match=r"dflop\.plan\.pipeline_stages is 2, but the plan says 3"):
        check_training_setup(ds(48, 2, 8), DFLOPConfig.from_settings(pipeline_stages=2), 6, plan=three)
    block = DFLOPConfig.from_settings(pipeline_stages=2, stage_bounds=[0, 5, 8])
    with pytest.raises(SetupError, match=r"dflop\.plan\.stage_bounds is \[0, 5, 8\], but the plan says \[0, 4, 8\]"):
        check_training_setup(ds(), block, 2, plan=plan(), n_layers=N_LAYERS)


def test_plan_batch_arithmetic_that_would_shrink_the_batch_is_refused():
    uneven = plan(dp=1, n_mb=8, global_batch=36)  # DeepSpeed would train 32 per step
    with pytest.raises(SetupError, match="global_batch_size=36 is not a multiple of dp=1 x n_mb=8"):
        check_training_setup(ds(32, 4, 8), DFLOPConfig.from_settings(pipeline_stages=2), 2, plan=uneven)


def test_config_stages_contradicting_the_plan_are_named_when_filling_from_it():
    one_stage = plan(stages=((3, 1, 4),))
    with pytest.raises(ValueError, match=r"dflop\.plan\.pipeline_stages is 2, but the plan is for 1"):
        fill_from_plan({}, set_settings({}, pipeline_stages=2), one_stage)
    config, block = fill_from_plan({}, set_settings({}, pipeline_stages=1), one_stage)
    assert get_setting(block, "stage_bounds") == [0, 8] and config["gradient_accumulation_steps"] == 8


def test_cost_model_of_another_depth_is_refused_naming_both():
    from dflop_ds.cost import reference_model

    model = reference_model("llava-ov-0.5b-a100")
    check_cost_model(model, encoder_layers=model.encoder_layers, llm_layers=model.llm_layers)
    with pytest.raises(
        SetupError,
        match=rf"profiled for {model.encoder_layers} encoder and {model.llm_layers} LLM"
        r" layers, but the model has 4 encoder and 4 LLM layers",
    ):
        check_cost_model(model, encoder_layers=4, llm_layers=4, source="costmodel.json")
    check_cost_model(object(), encoder_layers=4, llm_layers=4)  # records no depth (the proxy): nothing to check


def test_plan_global_batch_must_fill_every_microbatch():
    small = plan(dp=2, n_mb=8)
    small.global_batch_size = 8  # fewer samples than 8 microbatches x 2 ranks
    with pytest.raises(SetupError, match="global_batch_size=8 cannot give n_mb=8 non-empty microbatches"):
        check_training_setup(ds(32, 2, 8), DFLOPConfig.from_settings(pipeline_stages=2), 4, plan=small)


def test_dataset_smaller_than_one_global_batch_is_refused():
    block = DFLOPConfig.from_settings(pipeline_stages=2, data="some.jsonl", max_samples=20)
    with pytest.raises(
        SetupError,
        match=r"dflop\.data\.path \(some\.jsonl\) has 20 usable samples \(max_samples=20\),"
        r" fewer than one global batch \(train_batch_size=32\)",
    ):
        check_training_setup(ds(), block, 2, n_samples=20)
    check_training_setup(ds(), block, 2, n_samples=32)


def test_setup_error_is_a_value_error():
    assert issubclass(SetupError, ValueError)


def test_time_limited_solver_is_refused_when_ranks_schedule_independently():
    with pytest.raises(SetupError, match=r"dflop\.sampler\.time_limit_s=0\.5: each of the 2 processes"):
        check_training_setup(ds(), DFLOPConfig.from_settings(pipeline_stages=2, time_limit_s=0.5), 2)
    check_training_setup(ds(32, 4, 8), DFLOPConfig.from_settings(pipeline_stages=1, time_limit_s=0.5), 1)
    check_training_setup(ds(), DFLOPConfig.from_settings(pipeline_stages=2, time_limit_s=0), 2)


def test_a_node_limited_solver_is_allowed_on_several_ranks():
    check_training_setup(ds(), DFLOPConfig.from_settings(pipeline_stages=2, ilp_nodes=500), 2)
    with pytest.raises(SetupError, match="ilp_nodes"):  # the refusal names the alternative
        check_training_setup(ds(), DFLOPConfig.from_settings(pipeline_stages=2, time_limit_s=0.5, ilp_nodes=500), 2)
    with pytest.raises(ValueError, match=r"dflop\.sampler\.ilp_nodes"):
        DFLOPConfig.from_settings(ilp_nodes=-1)


@pytest.mark.slow
def test_train_script_prints_the_skip_report_and_refuses_the_setup(tmp_path):
    """examples/train.py, one process: bad records are skipped and listed, then the too-small
    dataset is refused before any engine is built, and before the tiny model's cost model is
    profiled (an empty profile cache stays empty)."""
    data = tmp_path / "data.jsonl"
    data.write_text(
        '{"id": "a", "text_tokens": 5}\n{"id": "b", "text_tokens": -1}\nnot json\n{"id": "c", "text_tokens": 7}\n'
    )
    config = json.loads((ROOT / "ds_configs" / "tiny_mllm_pp2.json").read_text())
    set_settings(config["dflop"], data=str(data), on_bad_sample="skip", pipeline_stages=1)
    config.pop("csv_monitor", None)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    env = {
        **os.environ,
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(29400 + os.getpid() % 1000),
        CACHE_ENV: str(tmp_path / "profile_cache"),
    }
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train.py"), "--deepspeed_config", str(path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "read 2 of 4 records, skipped 2 bad record(s)" in output
    assert f"skipped: {data} line 2 (id 'b'), field 'text_tokens'" in output
    assert f"skipped: {data} line 3: malformed JSON" in output
    assert "SetupError" in output and "has 2 usable samples" in output and "train_batch_size=32" in output
    assert not (tmp_path / "profile_cache").exists() or not any((tmp_path / "profile_cache").iterdir())
