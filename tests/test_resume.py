"""Checkpoint and resume of a 2-rank DeepSpeed run: nothing lost, nothing repeated, same schedule."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest
from conftest import DFLOP_PP2

STEPS = 6


def steps(trace: Path) -> dict[int, list[list[int]]]:
    return {line["step"]: line["microbatches"] for line in map(json.loads, trace.read_text().splitlines())}


@pytest.mark.slow
def test_killed_run_resumes_without_losing_or_repeating_a_sample(tmp_path, ds_config, run_train, dflop_pp2_run):
    """The shared uninterrupted run (same data, batches and solver) is the reference schedule."""
    dflop = {
        **DFLOP_PP2["dflop"],
        "steps": STEPS,
        "warmup_steps": 0,
        "checkpoint_dir": str(tmp_path / "ckpt"),
        "checkpoint_every": 2,
    }
    path = ds_config("tiny_mllm_pp2.json", dflop, **DFLOP_PP2["ds"])
    reference = {s: mbs for s, mbs in steps(dflop_pp2_run["trace"]).items() if s < STEPS}

    # dies after step 2
    run_train(path, "--trace", str(tmp_path / "killed.jsonl"), "--exit-after-step", "2", expect=17)
    killed = steps(tmp_path / "killed.jsonl")
    assert sorted(killed) == [0, 1, 2]
    run_train(path, "--trace", str(tmp_path / "resumed.jsonl"), "--resume")
    resumed = steps(tmp_path / "resumed.jsonl")
    assert sorted(resumed) == [2, 3, 4, 5], "resume must restart after the last checkpoint (step 2)"

    # steps 0-1 were checkpointed; step 2 was lost with the crash and is trained again
    trained = [i for s in (0, 1) for mb in killed[s] for i in mb]
    trained += [i for mb_list in resumed.values() for mb in mb_list for i in mb]
    counts = collections.Counter(trained)
    expected = sorted(i for mbs in reference.values() for mb in mbs for i in mb)
    assert len(expected) == STEPS * DFLOP_PP2["ds"]["train_batch_size"] and len(set(expected)) == len(expected)
    assert sorted(counts) == expected and set(counts.values()) == {1}
    # and the schedule after resume is the uninterrupted one
    assert {s: resumed[s] for s in resumed} == {s: reference[s] for s in resumed}
    assert {s: killed[s] for s in killed} == {s: reference[s] for s in killed}
