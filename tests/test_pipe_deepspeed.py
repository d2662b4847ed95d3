"""Real 2-rank DeepSpeed pipeline runs of the tiny MLLM (CPU accelerator, gloo).

One launch of tests/ds_scripts/tiny_pipe_train.py with ``deepspeed --num_gpus 2`` trains the three
variants below one after the other (a new engine each) in one process group. The
microbatches of a step have 1, 3 and 2 samples of varying text lengths and tile counts (a
zero-tile microbatch included). After step 1 (SGD), the parameters of both pipeline stages must
equal those of a single-process reference that ran the global batch as one batch with a
token-mean loss: that checks the token-normalized loss and the variable-shape pipeline together.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from ds_runs import run_pipeline_variants

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "ds_scripts" / "tiny_pipe_train.py"
STEPS = 20


#: the runs of the one launch: their script options
VARIANTS = {
    "trainable": ["--ckpt", "1"],  # encoder + projector on stage 0, LLM on stage 1; activation checkpointing
    "frozen": ["--freeze", "--bounds", "0,5,11"],  # a frozen encoder alone on stage 0
    "packed": ["--packed"],
}


@pytest.fixture(scope="module")
def pipeline_runs(tmp_path_factory) -> dict[str, list[dict]]:
    """Each variant's reports (stage 0's, stage 1's), from one launch."""
    out = tmp_path_factory.mktemp("pipe")
    return run_pipeline_variants(SCRIPT, out, ["--out", out, "--steps", STEPS], VARIANTS, timeout=900)


def check_training(results: list[dict]) -> None:
    losses = results[0]["losses"]
    assert results[1]["losses"] == losses  # the loss is broadcast to every stage
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
    # the same 4 global batches cycle: compare the first and the last cycle
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert last < 0.6 * first, f"loss did not go down: first cycle {first:.3f}, last cycle {last:.3f}"
    assert 0 in results[0]["tiles_per_microbatch"][0]  # a microbatch without any tile was trained


def check_step1_matches_reference(results: list[dict]) -> None:
    for r in results:
        # the engine reports the global token-mean loss, as the one-batch reference computes it
        assert r["losses"][0] == pytest.approx(r["ref_loss"], rel=1e-5)
        assert r["step1_max_param_diff"] <= 1e-6 + 1e-4 * r["step1_max_param_change"], r


@pytest.mark.slow
def test_trainable_encoder_two_stages(pipeline_runs) -> None:
    """Encoder + projector on stage 0, LLM on stage 1; activation checkpointing on."""
    results = pipeline_runs["trainable"]
    assert [r["parts"] for r in results] == [[0, 6, 11]] * 2
    check_step1_matches_reference(results)
    assert all(r["step1_max_param_change"] > 1e-4 for r in results)  # both stages really trained
    check_training(results)


@pytest.mark.slow
def test_frozen_encoder_alone_on_stage0(pipeline_runs) -> None:
    """A frozen encoder alone on stage 0: its outputs cross the boundary without grad history."""
    results = pipeline_runs["frozen"]
    stage0, stage1 = results
    assert stage0["parts"] == [0, 5, 11]
    assert stage0["n_frozen"] == stage0["n_params"] > 0 and not stage0["frozen_moved"]
    assert stage0["step1_max_param_change"] == 0.0 and stage1["n_frozen"] == 0
    check_step1_matches_reference(results)
    check_training(results)


@pytest.mark.slow
def test_packed_microbatches_two_stages(pipeline_runs) -> None:
    """Packed microbatches through the dynamic-shape pipeline equal the padded one-batch reference."""
    results = pipeline_runs["packed"]
    check_step1_matches_reference(results)
    assert all(r["step1_max_param_change"] > 1e-4 for r in results)
    check_training(results)
