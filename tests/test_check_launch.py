"""``dflop-ds check-launch``: a launch for N nodes x G GPUs checked without starting DeepSpeed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import write_ds_config
from ds_runs import REPO
from tiny_plans import two_stage_plan

from dflop_ds.commands.main import main as cli_main
from dflop_ds.config import plan_deepspeed_config, set_settings

DATA = REPO / "examples" / "data" / "mixture.jsonl"


def check_launch(config: Path, nodes: int, gpus: int, *args: str) -> list[str]:
    return [
        "check-launch",
        "--nodes",
        str(nodes),
        "--gpus-per-node",
        str(gpus),
        "--deepspeed_config",
        str(config),
        *args,
    ]


def planned_config(tmp_path: Path) -> tuple[Path, Path]:
    """A 2-GPU plan of the tiny model and the DeepSpeed config it fills in; their paths."""
    plan = two_stage_plan(memory_cap_bytes=2e9)
    plan_path, config_path = tmp_path / "plan.json", tmp_path / "config.json"
    plan.save(plan_path)
    config = plan_deepspeed_config(plan, {"dflop": {"data": {"path": str(DATA), "policy": "tiny"}}})
    set_settings(config["dflop"], plan=str(plan_path))
    config_path.write_text(json.dumps(config))
    return config_path, plan_path


def test_accepts_a_consistent_launch_and_prints_its_arithmetic(tmp_path, capsys):
    config = write_ds_config(tmp_path / "config.json", "tiny_mllm_pp2.json", {"max_samples": 320})
    assert cli_main(check_launch(config, 1, 2)) == 0
    out = capsys.readouterr().out
    assert "train_batch_size 32 = micro 4 x GAS 8 x dp 1" in out
    assert "320 samples" in out and "10 global batches per epoch" in out
    assert "sync: pipeline: 1F1B pipeline" in out  # two stages: the pipeline paces the ranks
    assert "check-launch: OK for 1 node(s) x 2 GPU(s)" in out


def test_a_planned_launch_passes_on_its_world_size_and_reports_the_plans_memory_cap(tmp_path, capsys):
    config, plan = planned_config(tmp_path)
    assert cli_main(check_launch(config, 1, 2)) == 0
    out = capsys.readouterr().out
    assert f"plan: {plan}, made for 2 GPUs" in out
    assert "memory cap 2 GB of activations per device (from the plan)" in out
    assert cli_main(check_launch(config, 2, 1)) == 0  # the same world size on two nodes: a note, no refusal
    assert "the plan assumed 2 GPUs per node, this launch has 1" in capsys.readouterr().out


def test_refuses_a_world_size_the_plan_was_not_made_for_naming_both(tmp_path, capsys):
    config, _ = planned_config(tmp_path)
    assert cli_main(check_launch(config, 2, 2)) == 1
    error = capsys.readouterr().err
    assert "2 node(s) x 2 GPU(s) = world size 4" in error
    assert "this plan is for 2 GPUs, but the run has world size 4" in error


@pytest.mark.parametrize(
    ("keys", "nodes", "gpus", "message"),
    [
        ({}, 2, 2, "train_batch_size=32 must equal train_micro_batch_size_per_gpu=4 x gradient_accumulation_steps=8"),
        ({"train_batch_size": 30, "gradient_accumulation_steps": None}, 1, 2, "train_batch_size=30 is not a multiple"),
    ],
)
def test_refuses_batch_arithmetic_that_does_not_divide(tmp_path, capsys, keys, nodes, gpus, message):
    config = write_ds_config(tmp_path / "config.json", "tiny_mllm_pp2.json", **keys)
    assert cli_main(check_launch(config, nodes, gpus)) == 1
    assert message in capsys.readouterr().err


def test_refuses_pipeline_stages_that_do_not_divide_the_world(tmp_path, capsys):
    config = write_ds_config(tmp_path / "config.json", "tiny_mllm_pp2.json")
    assert cli_main(check_launch(config, 1, 3)) == 1
    assert "dflop.plan.pipeline_stages=2 does not divide the world size 3" in capsys.readouterr().err


def test_refuses_a_tensor_parallel_size_that_does_not_divide_the_world(tmp_path, capsys):
    """Refused from the config alone, before any model is loaded (the model folder need not exist)."""
    config = write_ds_config(tmp_path / "config.json", "hf_tp2.json")
    assert cli_main(check_launch(config, 3, 1, "--model_name_or_path", str(tmp_path / "not-loaded"))) == 1
    assert "tensor_parallel.autotp_size=2 does not divide the world size 3" in capsys.readouterr().err


def test_refuses_a_data_set_smaller_than_one_global_batch_of_the_larger_world(tmp_path, capsys):
    config = write_ds_config(tmp_path / "config.json", "tiny_mllm_pp2.json", {"max_samples": 40})
    assert cli_main(check_launch(config, 1, 2)) == 0
    capsys.readouterr()
    bigger = write_ds_config(
        tmp_path / "bigger.json", "tiny_mllm_pp2.json", {"max_samples": 40}, train_batch_size=64
    )  # 4 ranks, dp 2: 64 = 4 x 8 x 2
    assert cli_main(check_launch(bigger, 2, 2)) == 1
    assert "has 40 usable samples" in capsys.readouterr().err
