"""The colocated (dispatched, data parallel over all ranks) encoder beside DeepSpeed's pipeline engine."""

from __future__ import annotations

import pytest
from conftest import run_colocated_check
from test_colocated_zero import assert_colocated_matches_local


@pytest.mark.slow
def test_colocated_dispatch_pp2_matches_in_pipeline_encoder_losses_and_gradients(colocated_reports):
    """Both modes: same losses and parameters after every SGD step as the encoder on stage 0."""
    assert_colocated_matches_local(colocated_reports["pp2"])


@pytest.mark.slow
def test_colocated_dispatch_pp2_dp2_four_ranks_matches_in_pipeline_encoder(tmp_path):
    assert_colocated_matches_local(run_colocated_check(tmp_path, "pp2", ranks=4)["pp2"])


def test_colocated_stage_bounds_drop_the_encoder_and_keep_the_projector_on_stage_0():
    from dflop_ds.train.colocated import colocated_pipeline_bounds, colocated_stage_bounds

    # flat list: 5 encoder layers, projector (5), 4 decoder blocks, head (10); colocated: receiver, projector, ...
    assert colocated_stage_bounds([0, 8, 11], n_encoder=5) == [0, 4, 7]
    with pytest.raises(ValueError, match="projector"):
        colocated_stage_bounds([0, 5, 11], n_encoder=5)
    assert colocated_pipeline_bounds(None, 5, None, [], 2) is None


def test_colocated_dispatch_under_a_pipeline_gives_the_samples_to_first_stages_and_work_to_every_rank():
    import numpy as np

    from dflop_ds.train.colocated import DispatchingSampler

    class TwoReplicas:  # the part of a sampler the dispatch reads: two data-parallel replicas, one micro-step
        dp_size, dp_rank, n_mb = 2, 1, 1

    tiles, cost = np.array([8, 8, 0, 0]), np.array([1.0, 1.0, 0.0, 0.0])
    schedule = type("Schedule", (), {"split": type("Split", (), {"ranks": [[[0, 2]], [[1, 3]]]})()})()
    # pp2 x dp2, DeepSpeed's topology: replica d's first stage is global rank d, its last stage d + 2
    sampler = DispatchingSampler(TwoReplicas(), tiles, cost, owners=[0, 1], rank=3, ranks=4)
    (request,) = sampler._request(schedule, 0, [1, 3])
    plan = request.plan
    assert plan.microbatches == ((0, 2), (1, 3), (), ())
    assert plan.loads == pytest.approx((4.0, 4.0, 4.0, 4.0))  # 16 tiles over 4 ranks
    assert all(piece.owner in (0, 1) for work in plan.work for piece in work)
    assert request.rank == 3 and sum(plan.send_counts(3)) == 4 and sum(plan.recv_counts(3)) == 0
    with pytest.raises(ValueError, match="owners"):
        DispatchingSampler(TwoReplicas(), tiles, cost, owners=[0, 4], rank=0, ranks=4)


@pytest.mark.slow
def test_colocated_dispatch_pipeline_training_loop_resumes_encoder_and_trains_every_sample_once(
    tmp_path, ds_config, run_train
):
    import collections
    import re

    from test_train_zero import BATCH, GAS, SAMPLES, STEPS_PER_EPOCH, reference_token_mean_loss, trace_lines

    dflop = {
        "max_samples": SAMPLES,
        "encoder": "colocated",
        "steps": STEPS_PER_EPOCH,
        "warmup_steps": 0,
        "lr": 0.003,
        "checkpoint_dir": str(tmp_path / "ckpt"),
        "checkpoint_every": 2,
    }
    path = ds_config(
        "tiny_mllm_pp2.json",
        dflop,
        train_batch_size=BATCH,
        train_micro_batch_size_per_gpu=BATCH // GAS,
        gradient_accumulation_steps=GAS,
        csv_monitor={"enabled": False},
    )
    killed, resumed = tmp_path / "killed.jsonl", tmp_path / "resumed.jsonl"
    killed_run = run_train(path, "--trace", str(killed), "--exit-after-step", "2", expect=17)
    out = killed_run.stdout + killed_run.stderr
    assert (tmp_path / "ckpt" / "encoder" / "step2").is_dir(), "the encoder's own engine saved no checkpoint"
    run_train(path, "--trace", str(resumed), "--resume")
    done = [line for line in trace_lines(killed) if line["step"] < 2] + trace_lines(resumed)
    assert sorted({line["step"] for line in trace_lines(resumed)}) == [2, 3, 4, 5]
    counts = collections.Counter(i for line in done for mb in line["microbatches"] for i in mb)
    assert sorted(counts) == list(range(SAMPLES)) and set(counts.values()) == {1}
    step0 = [i for line in trace_lines(killed) if line["step"] == 0 for mb in line["microbatches"] for i in mb]
    loss0 = float(re.search(r"step\s+0 loss (\S+)", out).group(1))
    assert loss0 == pytest.approx(reference_token_mean_loss(step0), rel=1e-3)


def test_colocated_encoder_setup_runs_under_the_pipeline_and_refuses_what_it_cannot_do():
    from dflop_ds.config import DFLOPConfig, set_settings
    from dflop_ds.setup_checks import SetupError, check_engine_features

    def config(**settings):
        return DFLOPConfig.from_dict(set_settings({}, encoder="colocated", **settings))

    check_engine_features(config(pipeline_stages=2))
    check_engine_features(config(model_name_or_path="some/dir", pipeline_stages=1))  # HF models: the plain engine
    with pytest.raises(SetupError, match="plain engine only"):
        check_engine_features(config(model_name_or_path="some/dir", pipeline_stages=2))
    with pytest.raises(SetupError, match="correction"):
        check_engine_features(config(correction={"enabled": True}))
