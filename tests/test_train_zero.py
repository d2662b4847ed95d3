"""The training loop on DeepSpeed's plain engine with ZeRO-2 data parallel (no pipeline), 2 CPU ranks."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SAMPLES, BATCH, GAS = 96, 16, 4
STEPS_PER_EPOCH = SAMPLES // BATCH


@pytest.fixture
def zero2_config(ds_config):
    """``zero2_config(**dflop) -> path``: the bundled ZeRO-2 config on the tiny model, ``dflop`` keys overridden."""

    def write(**dflop) -> Path:
        return ds_config(
            "tiny_zero2.json",
            {"max_samples": SAMPLES, **dflop},
            train_batch_size=BATCH,
            train_micro_batch_size_per_gpu=BATCH // (2 * GAS),
            gradient_accumulation_steps=GAS,
        )

    return write


def trace_lines(trace: Path) -> list[dict]:
    return [json.loads(line) for line in trace.read_text().splitlines()]


def reference_token_mean_loss(sample_ids: list[int]) -> float:
    """The token-mean loss of the tiny model (seed 0) on these samples run as one batch."""
    from dflop_ds.data import read_dataset
    from dflop_ds.models import TinyMLLMDataset, build_reference, collate_microbatch
    from dflop_ds.pipe import token_normalized_loss
    from dflop_ds.shapes import TINY_POLICY

    shapes = read_dataset(ROOT / "examples" / "data" / "mixture.jsonl", TINY_POLICY)[:SAMPLES]
    dataset = TinyMLLMDataset(shapes, seed=0)
    inputs, labels = collate_microbatch([dataset[i] for i in sample_ids])
    with torch.no_grad():
        return float(token_normalized_loss(build_reference(seed=0)(inputs), labels))


def assert_every_sample_once_token_mean_loss_and_learning(lines: list[dict], run: dict) -> None:
    """An epoch's trace trained every sample once, step 0 reported the global batch's token-mean
    loss (both ranks), and the loss fell."""
    counts = collections.Counter(i for line in lines for mb in line["microbatches"] for i in mb)
    assert sorted(counts) == list(range(SAMPLES)) and set(counts.values()) == {1}
    step0 = [i for line in lines if line["step"] == 0 for mb in line["microbatches"] for i in mb]
    assert run["steps"][0]["loss"] == pytest.approx(reference_token_mean_loss(step0), rel=1e-4)
    losses = [s["loss"] for s in run["steps"]]
    assert np.mean(losses[-2:]) < np.mean(losses[:2]), losses


@pytest.mark.slow
@pytest.mark.parametrize("sampler", ["dflop", "stock"])
def test_zero2_data_parallel_trains_every_sample_once_with_the_global_token_mean_loss(
    tmp_path, sampler, zero2_config, run_train
):
    config = zero2_config(sampler=sampler, steps=STEPS_PER_EPOCH, warmup_steps=1, lr=0.003)
    trace, summary = tmp_path / "trace.jsonl", tmp_path / "summary.json"
    run_train(config, "--trace", str(trace), "--summary", str(summary))
    run = json.loads(summary.read_text())
    assert run["summary"]["engine"] == "plain" and run["summary"]["zero_stage"] == 2 and run["summary"]["dp"] == 2

    lines = trace_lines(trace)
    assert sorted((line["step"], line["dp_rank"]) for line in lines) == [
        (s, r) for s in range(STEPS_PER_EPOCH) for r in range(2)
    ]
    assert all(len(line["microbatches"]) == GAS and all(line["microbatches"]) for line in lines)
    assert_every_sample_once_token_mean_loss_and_learning(lines, run)
    if sampler == "dflop":
        assert_each_micro_step_balanced_across_ranks(lines)


def assert_each_micro_step_balanced_across_ranks(lines: list[dict]) -> None:
    """Micro-step k of both ranks costs about the same (the ranks meet in every backward)."""
    from dflop_ds.cost import ProxyCost
    from dflop_ds.data import read_dataset
    from dflop_ds.shapes import TINY_POLICY

    shapes = read_dataset(ROOT / "examples" / "data" / "mixture.jsonl", TINY_POLICY)[:SAMPLES]
    cost = ProxyCost().predict_samples(shapes).sum(axis=1)
    by_step: dict[int, dict[int, list[float]]] = collections.defaultdict(dict)
    for line in lines:
        by_step[line["step"]][line["dp_rank"]] = [cost[mb].sum() for mb in line["microbatches"]]
    for step, ranks in by_step.items():
        per_k = np.array([ranks[0], ranks[1]])  # (dp, GAS)
        assert (per_k.max(axis=0) / per_k.mean(axis=0)).max() < 1.35, (step, per_k)


@pytest.mark.slow
def test_zero2_killed_run_resumes_without_losing_or_repeating_a_sample(tmp_path, zero2_config, run_train):
    config = zero2_config(
        sampler="dflop",
        steps=STEPS_PER_EPOCH,
        warmup_steps=0,
        checkpoint_dir=str(tmp_path / "ckpt"),
        checkpoint_every=2,
    )
    killed, resumed = tmp_path / "killed.jsonl", tmp_path / "resumed.jsonl"
    run_train(config, "--trace", str(killed), "--exit-after-step", "2", expect=17)
    run_train(config, "--trace", str(resumed), "--resume")
    done = [line for line in trace_lines(killed) if line["step"] < 2] + trace_lines(resumed)
    assert sorted({line["step"] for line in trace_lines(resumed)}) == [2, 3, 4, 5]
    counts = collections.Counter(i for line in done for mb in line["microbatches"] for i in mb)
    assert sorted(counts) == list(range(SAMPLES)) and set(counts.values()) == {1}
