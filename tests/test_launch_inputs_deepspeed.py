"""One source of truth per launch, on DeepSpeed's launcher: two ranks whose profile caches hold
different cost models train with rank 0's, with one schedule (dflop_ds.train.launch_inputs)."""

from __future__ import annotations

import json

import pytest
from conftest import write_ds_config
from ds_runs import REPO, run_on_ranks

from dflop_ds.cost import cost_model_from_dict, cost_model_to_dict
from dflop_ds.models.source import tiny_source
from dflop_ds.models.tiny_profile import cached_tiny_cost_model, tiny_model_identity
from dflop_ds.plan.stages import cost_balanced_bounds
from dflop_ds.profile.cache import profile_key, store_cost_model
from dflop_ds.train.launch_inputs import AUTO_PROFILE_REPEATS, json_digest

pytestmark = pytest.mark.slow

MODEL = {"vision_layers": 2, "llm_layers": 4}
#: a small, fast profile of the tiny model
FAST = dict(tiles=(1, 4), seq_lens=(16, 64), batch_sizes=(1, 2), warmup=0, repeats=1, progress=False)
DFLOP = {"model": MODEL, "sampler": "dflop", "max_samples": 64, "steps": 3, "warmup_steps": 0, "ilp_nodes": 200}
BATCH = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4}


def test_ranks_with_different_cached_cost_models_train_one_schedule(tmp_path):
    profiled, _ = cached_tiny_cost_model(MODEL, tmp_path / "profile", log=lambda _: None, **FAST)
    state = cost_model_to_dict(profiled)
    slow_encoder = json.loads(json.dumps(state))  # another machine's profile: an encoder 50x slower
    fits = slow_encoder["state"]["fits"]
    fits["encoder_time"]["coef"] = [50 * c for c in fits["encoder_time"]["coef"]]
    own = {0: profiled, 1: cost_model_from_dict(slow_encoder)}
    shapes = tiny_source(MODEL, policy_name="tiny").read_shapes(str(REPO / "examples/data/mixture.jsonl"), "error")
    bounds = {rank: list(cost_balanced_bounds(own[rank], shapes[:64], 2)) for rank in own}
    assert bounds[0] != bounds[1]  # each rank on its own cost model would build other stages

    key = profile_key(tiny_model_identity(MODEL), {"repeats": AUTO_PROFILE_REPEATS})  # what the run looks up
    caches = tmp_path / "caches"
    files = {rank: store_cost_model(own[rank], caches / f"rank{rank}", key) for rank in own}
    written = {rank: files[rank].stat().st_mtime_ns for rank in own}

    config = write_ds_config(tmp_path / "config.json", "tiny_mllm_pp2.json", DFLOP, **BATCH)
    summary = tmp_path / "summary.json"
    result = run_on_ranks(
        REPO / "tests" / "ds_scripts" / "per_rank_cache_train.py",
        ["--deepspeed_config", config, "--summary", summary, "--telemetry", tmp_path / "telemetry.jsonl"],
        extra_env={"DFLOP_DS_CACHE_PER_RANK": str(caches)},
        timeout=400,
    )
    # every step's telemetry compared the schedules of both ranks (check_same_schedule) and passed
    telemetry = [json.loads(line) for line in (tmp_path / "telemetry.jsonl").read_text().splitlines()]
    assert len(telemetry) == DFLOP["steps"]
    run = json.loads(summary.read_text())["summary"]
    assert run["stage_bounds"] == bounds[0]  # rank 0's cost model split the stages of both ranks
    assert f"cost model {json_digest(json.loads(json.dumps(state)))}" in result.stdout
    assert str(files[0]) in result.stdout  # named as the cost model's source
    assert {rank: files[rank].stat().st_mtime_ns for rank in own} == written  # nobody profiled again
    assert sorted(p.name for p in (caches / "rank1").iterdir() if p.suffix == ".json") == sorted(
        [files[1].name, files[1].with_suffix(".key.json").name]
    )
