"""The colocated (dispatched) encoder on DeepSpeed's plain engine, ZeRO-2, 2 CPU ranks."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_colocated_dispatch_zero2_dp2_matches_local_encoder_losses_and_gradients(colocated_reports):
    assert_colocated_matches_local(colocated_reports["zero2"])


def assert_colocated_matches_local(report: dict) -> None:
    """A check script's report: in both modes the colocated run's losses and parameters after
    every SGD step equal the local encoder's, tiles really moved, every sample trained once."""
    for mode in ("trainable", "frozen"):
        run = report[mode]
        assert run["foreign_tiles"] > 0, "no tile was dispatched away from its rank: the test proves nothing"
        assert run["losses_colocated"] == pytest.approx(run["losses_local"], rel=1e-5)
        # SGD: parameters after each step differ by lr * (gradient difference); 1e-4 of the largest
        # update is a few float32 ulps of parameters near 1 (batching the encoder changes rounding)
        assert max(run["max_param_diff"]) < 1e-4 * max(run["max_param_change"], 1e-3), run
        assert len(run["samples"]) == len(set(run["samples"]))  # every sample of the steps once
    assert report["trainable"]["encoder_change_colocated"] > 1e-4
    assert report["frozen"]["encoder_change_colocated"] == 0.0


@pytest.mark.slow
def test_colocated_dispatch_training_loop_trains_every_sample_once_and_learns(colocated_plan_run):
    """examples/train.py on ZeRO-2 with the colocated encoder (set by a colocated plan), one epoch."""
    from test_train_zero import BATCH, GAS, SAMPLES, assert_every_sample_once_token_mean_loss_and_learning, trace_lines

    run = colocated_plan_run["run"]
    assert (run["summary"]["train_batch_size"], run["summary"]["gradient_accumulation_steps"]) == (BATCH, GAS)
    assert len(run["steps"]) == SAMPLES // BATCH
    assert_every_sample_once_token_mean_loss_and_learning(trace_lines(colocated_plan_run["trace"]), run)


def test_colocated_encoder_key_is_validated():
    from dflop_ds.config import DFLOPConfig

    with pytest.raises(ValueError, match="encoder"):
        DFLOPConfig.from_dict({"model": {"encoder": "elsewhere"}}, source="cfg.json")
    assert DFLOPConfig.from_dict({"model": {"encoder": "colocated"}}).model.encoder == "colocated"
    assert DFLOPConfig().model.encoder == "local"


def test_colocated_encoder_is_refused_by_name_for_a_model_that_cannot_dispatch_its_tiles():
    import dataclasses

    from dflop_ds.models.source import tiny_source

    source = tiny_source({})
    assert source.colocated_tile_pixels() is source.tile_pixels
    with pytest.raises(ValueError, match="'qwen2_vl:m' cannot dispatch its encoder tiles"):
        dataclasses.replace(source, name="qwen2_vl:m", tile_pixels=None).colocated_tile_pixels()
