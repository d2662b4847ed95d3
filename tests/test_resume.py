"""Checkpoint and resume of a 2-rank DeepSpeed run: nothing lost, nothing repeated, same schedule."""

from __future__ import annotations

import collections
import json
import shutil
from pathlib import Path

import pytest

from dflop_ds.config import set_settings
from dflop_ds.launch import run_deepspeed

ROOT = Path(__file__).resolve().parent.parent
SAMPLES, BATCH, STEPS_PER_EPOCH = 96, 16, 6


def train(config: Path, trace: Path, *extra: str, expect: int = 0) -> None:
    result = run_deepspeed(
        ROOT / "examples" / "train.py", ["--deepspeed_config", str(config), "--trace", str(trace), *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=400,
    )
    assert result.returncode == expect, result.stdout[-3000:] + result.stderr[-3000:]


def steps(trace: Path) -> dict[int, list[list[int]]]:
    return {line["step"]: line["microbatches"] for line in map(json.loads, trace.read_text().splitlines())}


@pytest.mark.slow
def test_killed_run_resumes_without_losing_or_repeating_a_sample(tmp_path):
    config = json.loads((ROOT / "ds_configs" / "tiny_mllm_pp2.json").read_text())
    config.update(train_batch_size=BATCH, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=4)
    set_settings(config["dflop"], sampler="dflop", max_samples=SAMPLES, steps=STEPS_PER_EPOCH, warmup_steps=0,
                           checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=2)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))

    train(path, tmp_path / "reference.jsonl")  # one uninterrupted epoch
    reference = steps(tmp_path / "reference.jsonl")
    shutil.rmtree(tmp_path / "ckpt")

    train(path, tmp_path / "killed.jsonl", "--exit-after-step", "2", expect=17)  # dies after step 2
    killed = steps(tmp_path / "killed.jsonl")
    assert sorted(killed) == [0, 1, 2]
    train(path, tmp_path / "resumed.jsonl", "--resume")
    resumed = steps(tmp_path / "resumed.jsonl")
    assert sorted(resumed) == [2, 3, 4, 5], "resume must restart after the last checkpoint (step 2)"

    # steps 0-1 were checkpointed; step 2 was lost with the crash and is trained again
    trained = [i for s in (0, 1) for mb in killed[s] for i in mb]
    trained += [i for mb_list in resumed.values() for mb in mb_list for i in mb]
    counts = collections.Counter(trained)
    assert sorted(counts) == list(range(SAMPLES)) and set(counts.values()) == {1}
    # and the schedule after resume is the uninterrupted one
    assert {s: resumed[s] for s in resumed} == {s: reference[s] for s in resumed}
    assert {s: killed[s] for s in killed} == {s: reference[s] for s in killed}
