"""examples/train.py under a real 2-rank DeepSpeed launch (2 pipeline stages, CPU/gloo here)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_plans import two_stage_plan

from dflop_ds.config import set_settings

ROOT = Path(__file__).resolve().parent.parent
SIXTEEN_IN_FOUR = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4}


@pytest.fixture
def launch_training(tmp_path: Path, ds_config, run_train):
    """``launch_training(dflop, ds=None, timeout=400, args=())``: examples/train.py on 2 ranks with the
    bundled pp2 config (``dflop`` and DeepSpeed keys ``ds`` overridden, plus ``args``); its summary."""

    def launch(dflop: dict, ds: dict | None = None, timeout: int = 400, args: tuple[str, ...] = ()) -> dict:
        summary = tmp_path / "summary.json"
        run_train(
            ds_config("tiny_mllm_pp2.json", dflop, **(ds or {})), "--summary", str(summary), *args, timeout=timeout
        )
        return json.loads(summary.read_text())

    return launch


@pytest.mark.slow
def test_two_rank_pipeline_training_with_varying_shapes_lowers_the_loss(dflop_pp2_run):
    run = dflop_pp2_run["run"]
    steps = run["steps"]
    assert len(steps) == 20
    losses = [s["loss"] for s in steps]
    assert not any(math.isnan(loss) for loss in losses), "loss is NaN"
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses
    # the microbatches really varied in shape: sample counts and token counts differ step to step
    assert len({s["tokens"] for s in steps}) > 10
    assert any(len(set(s["microbatch_sizes"])) > 1 for s in steps)
    assert run["summary"]["samples_per_s"] > 0
    assert run["summary"]["truncated_samples"] == 0  # the tiny model never truncates
    # "auto" without a plan: the smallest device figure of the ranks, which the bundled data fits under
    cap = run["summary"]["memory_cap"]
    assert cap["source"] == "device" and cap["bytes"] > 0 and "the smallest of all ranks" in cap["detail"]


@pytest.mark.slow
def test_a_plan_file_starts_a_two_rank_training(tmp_path, run_train):
    plan = two_stage_plan(precision="fp32", memory_cap_bytes=2e9)
    plan.save(tmp_path / "plan.json")
    config = {
        "steps_per_print": 10**6,
        "dflop": set_settings({}, plan=str(tmp_path / "plan.json"), max_samples=60, steps=3, warmup_steps=1),
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    result = run_train(tmp_path / "config.json", "--summary", str(tmp_path / "summary.json"))
    output = result.stdout + result.stderr
    assert "memory cap 2 GB of activations per device (from the plan)" in output  # logged once, on rank 0
    assert output.count("memory cap") == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["summary"]["stage_bounds"] == plan.stage_bounds() == [0, 7, 11]
    assert summary["summary"]["gradient_accumulation_steps"] == 4
    assert summary["summary"]["train_batch_size"] == 12
    assert all(len(s["microbatch_sizes"]) == 4 and sum(s["microbatch_sizes"]) == 12 for s in summary["steps"])

    # a config that contradicts its plan is refused before training, naming the key
    config["gradient_accumulation_steps"] = 2
    (tmp_path / "config.json").write_text(json.dumps(config))
    result = run_train(tmp_path / "config.json", expect=None)
    assert "gradient_accumulation_steps" in result.stdout + result.stderr


@pytest.mark.slow
def test_an_engine_profile_fitted_from_a_two_rank_run_predicts_its_steps(tmp_path, launch_training):
    from dflop_ds.cost import load_cost_model
    from dflop_ds.data import read_dataset
    from dflop_ds.plan.engine_profile import EngineProfile, engine_profile_from_run, read_engine_steps
    from dflop_ds.shapes import TINY_POLICY

    cost_model = tmp_path / "costmodel.json"
    profiled = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflop_ds.commands.main",
            "profile",
            "model",
            "--no-progress",
            "--tiles",
            "1,8,32,96",
            "--seq-lens",
            "16,128,512,768",
            "--batch-sizes",
            "1,4",
            "--repeats",
            "2",
            "-o",
            str(cost_model),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert profiled.returncode == 0, profiled.stderr[-3000:]
    telemetry = tmp_path / "telemetry.jsonl"
    launch_training({"sampler": "stock", "steps": 8, "warmup_steps": 2}, args=("--telemetry", str(telemetry)))
    model = load_cost_model(cost_model)
    data = ROOT / "examples" / "data" / "mixture.jsonl"
    shapes = read_dataset(data, TINY_POLICY)
    fitted = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflop_ds.commands.main",
            "profile",
            "engine",
            str(telemetry),
            "--cost-model",
            str(cost_model),
            "--data",
            str(data),
            "--skip-steps",
            "2",
            "-o",
            str(tmp_path / "engine.json"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert fitted.returncode == 0, fitted.stderr[-3000:]
    assert "one blocking exchange" in fitted.stdout and "check on the profiled steps" in fitted.stdout
    engine = EngineProfile.load(tmp_path / "engine.json")
    assert engine.to_dict() == engine_profile_from_run(telemetry, shapes, model, skip_steps=2).to_dict()
    assert engine.meta["steps"] == 6 and engine.meta["stage_bounds"][0] == 0
    assert all(0 < s < 10 for s in engine.compute_scale) and 0 < engine.forward_fraction < 1
    assert all(x > 0 for x in engine.load_s) and all(x > 0 for x in engine.tail_s) and engine.exchange_s >= 0
    steps, bounds = read_engine_steps(telemetry, shapes, model, skip_steps=2)
    from dflop_ds.plan.stages import stage_shares

    shares = stage_shares(bounds, model)
    simulated = sum(engine.simulate(step.costs, shares).step_time for step in steps)
    measured = sum(step.step_s for step in steps)
    assert simulated == pytest.approx(measured, rel=0.25)
    assert engine.meta["simulated_mean_step_s"] == pytest.approx(simulated / len(steps))
    assert engine.meta["measured_mean_step_s"] == pytest.approx(measured / len(steps))


@pytest.mark.slow
def test_a_node_limited_exact_solver_gives_every_rank_the_same_schedule(dflop_pp2_run):
    # telemetry compares the ranks' schedule fingerprints every step and stops the run on a mismatch
    steps = dflop_pp2_run["run"]["steps"]
    assert len(steps) == 20 and all(s["schedule_ms"] > 0 for s in steps)


@pytest.mark.slow
def test_a_memory_cap_no_sample_fits_stops_before_training_naming_a_sample(ds_config, run_train):
    config = ds_config(
        "tiny_mllm_pp2.json", {"steps": 2, "warmup_steps": 1, "max_samples": 64, "memory_cap_bytes": 1000}
    )
    result = run_train(config, expect=None)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "OversizeSampleError" in output and "memory cap of 1000 bytes" in output and "allow_oversize" in output


def test_a_frozen_encoder_alone_on_a_stage_trains_with_gradient_clipping(launch_training):
    """Issue 25: freeze_encoder with the encoder alone on stage 0 crashed at the first step in
    DeepSpeed's gradient clipping (no gradient on that stage). Its zero anchor parameter gets one."""
    dflop = {"freeze_encoder": True, "stage_bounds": [0, 5, 11], "max_samples": 32, "steps": 2, "warmup_steps": 0}
    run = launch_training(dflop, ds={**SIXTEEN_IN_FOUR, "gradient_clipping": 1.0})
    assert run["summary"]["stage_bounds"] == [0, 5, 11]
    assert len(run["steps"]) == 2 and all(math.isfinite(step["loss"]) for step in run["steps"])
