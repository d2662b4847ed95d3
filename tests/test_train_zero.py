"""The training loop on DeepSpeed's plain engine with ZeRO-2 data parallel (no pipeline), 2 CPU ranks."""

from __future__ import annotations

import collections
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_train_script, write_ds_config

ROOT = Path(__file__).resolve().parent.parent
SAMPLES, BATCH, GAS = 96, 16, 4
STEPS_PER_EPOCH = SAMPLES // BATCH


def write_zero2_config(path: Path, **dflop) -> Path:
    """The bundled ZeRO-2 config on the tiny model, ``dflop`` keys overridden, written to ``path``."""
    return write_ds_config(
        path,
        "tiny_zero2.json",
        {"max_samples": SAMPLES, **dflop},
        train_batch_size=BATCH,
        train_micro_batch_size_per_gpu=BATCH // (2 * GAS),
        gradient_accumulation_steps=GAS,
    )


@pytest.fixture
def zero2_config(tmp_path):
    """``zero2_config(**dflop) -> path``: :func:`write_zero2_config` to ``tmp_path / "config.json"``."""
    return lambda **dflop: write_zero2_config(tmp_path / "config.json", **dflop)


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
    assert_epoch(lines, [s["loss"] for s in run["steps"]])


def assert_epoch(lines: list[dict], losses: list[float], loss_digits: int | None = None) -> None:
    """:func:`assert_every_sample_once_token_mean_loss_and_learning` on the epoch's losses
    (printed with ``loss_digits`` decimals, or exact)."""
    counts = collections.Counter(i for line in lines for mb in line["microbatches"] for i in mb)
    assert sorted(counts) == list(range(SAMPLES)) and set(counts.values()) == {1}
    step0 = [i for line in lines if line["step"] == 0 for mb in line["microbatches"] for i in mb]
    printed = 0.0 if loss_digits is None else 0.5 * 10.0**-loss_digits
    assert losses[0] == pytest.approx(reference_token_mean_loss(step0), rel=1e-4, abs=printed)
    assert np.mean(losses[-2:]) < np.mean(losses[:2]), losses


def printed_losses(output: str) -> list[float]:
    """The losses rank 0 printed, one per step."""
    return [float(value) for value in re.findall(r"step\s+\d+ loss (\d+\.\d+)", output)]


@pytest.fixture(scope="module")
def dflop_epoch(tmp_path_factory) -> dict:
    """The ZeRO-2 DFLOP epoch every test below asserts on, checkpointed every 2 steps: a run killed
    after step 2 and its resumed run. ``{"killed": trace lines, "killed_losses": printed losses,
    "resumed": trace lines, "run": the resumed run's summary}``."""
    folder = tmp_path_factory.mktemp("zero2_dflop")
    config = write_zero2_config(
        folder / "config.json",
        sampler="dflop",
        steps=STEPS_PER_EPOCH,
        warmup_steps=0,
        lr=0.003,
        checkpoint_dir=str(folder / "ckpt"),
        checkpoint_every=2,
    )
    killed, resumed, summary = folder / "killed.jsonl", folder / "resumed.jsonl", folder / "summary.json"
    killed_run = run_train_script(config, "--trace", killed, "--exit-after-step", 2, expect=17)
    run_train_script(config, "--trace", resumed, "--resume", "--summary", summary)
    return {
        "killed": trace_lines(killed),
        "killed_losses": printed_losses(killed_run.stdout + killed_run.stderr),
        "resumed": trace_lines(resumed),
        "run": json.loads(summary.read_text()),
    }


def check_epoch(lines: list[dict], run: dict, sampler: str, losses: list[float], loss_digits: int | None) -> None:
    """The plain ZeRO-2 engine on 2 ranks trained one epoch of GAS microbatches per step and rank,
    every sample once, with the global token-mean loss, and learned; DFLOP balanced each micro-step."""
    assert run["summary"]["engine"] == "plain" and run["summary"]["zero_stage"] == 2 and run["summary"]["dp"] == 2
    assert sorted((line["step"], line["dp_rank"]) for line in lines) == [
        (s, r) for s in range(STEPS_PER_EPOCH) for r in range(2)
    ]
    assert all(len(line["microbatches"]) == GAS and all(line["microbatches"]) for line in lines)
    assert_epoch(lines, losses, loss_digits)
    if sampler == "dflop":
        assert_each_micro_step_balanced_across_ranks(lines)


@pytest.mark.slow
@pytest.mark.parametrize("sampler", ["dflop", "stock"])
def test_zero2_data_parallel_trains_every_sample_once_with_the_global_token_mean_loss(
    tmp_path, sampler, zero2_config, run_train, request
):
    if sampler == "dflop":  # the killed and resumed runs of the shared epoch: steps 0-1, then 2-5
        epoch = request.getfixturevalue("dflop_epoch")
        lines = [line for line in epoch["killed"] if line["step"] < 2] + epoch["resumed"]
        losses = epoch["killed_losses"][:2] + [s["loss"] for s in epoch["run"]["steps"]]
        assert [s["step"] for s in epoch["run"]["steps"]] == [2, 3, 4, 5]
        check_epoch(lines, epoch["run"], sampler, losses, loss_digits=4)
        return
    config = zero2_config(sampler=sampler, steps=STEPS_PER_EPOCH, warmup_steps=1, lr=0.003)
    trace, summary = tmp_path / "trace.jsonl", tmp_path / "summary.json"
    run_train(config, "--trace", str(trace), "--summary", str(summary))
    run = json.loads(summary.read_text())
    check_epoch(trace_lines(trace), run, sampler, [s["loss"] for s in run["steps"]], loss_digits=None)


def assert_each_micro_step_balanced_across_ranks(lines: list[dict]) -> None:
    """The ranks meet in every micro-step, so a step costs, over the micro-steps, the slower rank's
    microbatch, column by column under ZeRO-2's ``module`` sync model: DFLOP's split stays within 10%
    of the lower bound any split of the step's samples has (:func:`dflop_ds.sync.step_lower_bound`)."""
    from dflop_ds.cost import ProxyCost
    from dflop_ds.data import read_dataset
    from dflop_ds.shapes import TINY_POLICY
    from dflop_ds.sync import step_cost, step_lower_bound

    shapes = read_dataset(ROOT / "examples" / "data" / "mixture.jsonl", TINY_POLICY)[:SAMPLES]
    cost = ProxyCost().predict_samples(shapes)
    by_step: dict[int, dict[int, list[list[int]]]] = collections.defaultdict(dict)
    for line in lines:
        by_step[line["step"]][line["dp_rank"]] = line["microbatches"]
    for step, ranks in by_step.items():
        split = [ranks[0], ranks[1]]
        per_k = np.array([[cost[mb].sum(axis=0) for mb in rank] for rank in split])  # (dp, GAS, columns)
        samples = [i for rank in split for mb in rank for i in mb]
        bound = step_lower_bound(cost[samples], 2, GAS, "module")
        assert step_cost(per_k, "module") <= 1.1 * bound, (step, per_k, bound)


@pytest.mark.slow
def test_zero2_killed_run_resumes_without_losing_or_repeating_a_sample(dflop_epoch):
    killed, resumed = dflop_epoch["killed"], dflop_epoch["resumed"]
    assert sorted({line["step"] for line in killed}) == [0, 1, 2]
    done = [line for line in killed if line["step"] < 2] + resumed
    assert sorted({line["step"] for line in resumed}) == [2, 3, 4, 5]
    counts = collections.Counter(i for line in done for mb in line["microbatches"] for i in mb)
    assert sorted(counts) == list(range(SAMPLES)) and set(counts.values()) == {1}

    # step 2, lost with the crash, is trained again with the same microbatches
    def step2(lines: list[dict]) -> list[dict]:  # the ranks append their lines in any order
        return sorted((line for line in lines if line["step"] == 2), key=lambda line: line["dp_rank"])

    assert step2(killed) == step2(resumed)
