"""Command options outside their meaning are refused when parsed, naming the option; commands that
cannot do what they are asked say why instead of answering something else."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflop_ds.commands.main import main
from tests.test_projection import MODEL, records


def refused(argv: list[str], capsys) -> str:
    """The error argparse printed for ``argv`` (it exits 2)."""
    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "nan", "-8", "inf"])
def test_project_refuses_a_gpu_memory_that_is_not_a_positive_number(value, capsys):
    argv = ["project", "--cost-model", MODEL, "--data", "x.jsonl", "--gpus", "8", "--gpu-memory-gb", value]
    assert f"--gpu-memory-gb: expected a finite number above 0, got {value!r}" in refused(argv, capsys)


def test_project_refuses_a_cluster_beyond_the_measured_planner_size(capsys):
    argv = ["project", "--cost-model", MODEL, "--data", "x.jsonl", "--gpus", "8", "1048576"]
    assert "--gpus: expected an integer in [1, 16384]" in refused(argv, capsys)


def test_check_model_refuses_a_negative_tolerance(capsys):
    assert "--tolerance: expected a finite number above 0, got '-1'" in refused(
        ["check-model", "some_dir", "--tolerance", "-1"], capsys
    )


def test_project_refuses_a_one_sample_data_set_and_shows_progress(tmp_path: Path, write_jsonl, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    one = write_jsonl(tmp_path / "one.jsonl", records(1))
    assert main(["project", "--cost-model", MODEL, "--data", str(one), "--gpus", "64"]) == 1
    assert "one.jsonl has 1 sample(s)" in capsys.readouterr().err
    mixed = write_jsonl(tmp_path / "mixed.jsonl", records(24))
    assert main(["project", "--cost-model", MODEL, "--data", str(mixed), "--gpus", "8", "--batches", "1"]) == 0
    printed = capsys.readouterr()
    assert "[1/1] planning 8 GPUs" in printed.err
    assert "note: a global batch of up to 16 samples is drawn from 24" not in printed.out  # 2 x 8 < 24: no note
    assert main(["project", "--cost-model", MODEL, "--data", str(mixed), "--gpus", "16", "--batches", "1"]) == 0
    assert "note: a global batch of up to 32 samples is drawn from 24: samples repeat" in capsys.readouterr().out


def test_validate_of_a_config_that_names_no_data_says_so(tmp_path: Path, capsys):
    config = tmp_path / "trainer.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "dflop": {"sampler": {"kind": "dflop"}}}))
    assert main(["validate", "--deepspeed-config", str(config)]) == 1
    err = capsys.readouterr().err
    assert f"{config}: its dflop block names no data file (dflop.data.path)" in err and "no problems" not in err


@pytest.mark.parametrize(
    "option, value, expected",
    [
        ("--global-batch", "0", "--global-batch: expected an integer of at least 1, got 0"),
        ("--batches", "0", "--batches: expected an integer of at least 1, got 0"),
        ("--top-k", "0", "--top-k: expected an integer of at least 1, got 0"),
        ("--max-tp", "0", "--max-tp: expected an integer of at least 1, got 0"),
        ("--gpus-per-node", "0", "--gpus-per-node: expected an integer of at least 1, got 0"),
        ("--seed", "-1", "--seed: expected an integer of at least 0, got -1"),
        ("--gpus", "1048576", "--gpus: expected an integer in [1, 16384]"),
    ],
)
def test_plan_refuses_counts_outside_their_meaning_naming_the_option(option, value, expected, capsys):
    argv = ["plan", "--cost-model", MODEL, "--data", "x.jsonl", "--gpus", "8", "--global-batch", "16", "-o", "p.json"]
    assert expected in refused(argv + [option, value], capsys)


def test_project_refuses_a_negative_seed_and_no_gpus_per_node(capsys):
    argv = ["project", "--cost-model", MODEL, "--data", "x.jsonl", "--gpus", "8"]
    assert "--seed: expected an integer of at least 0, got -1" in refused(argv + ["--seed", "-1"], capsys)
    no_node = refused(argv + ["--gpus-per-node", "0"], capsys)
    assert "--gpus-per-node: expected an integer of at least 1, got 0" in no_node
    for option in ("--max-tp", "--microbatches"):
        assert f"{option}: expected an integer of at least 1, got 0" in refused(argv + [option, "0"], capsys)


def test_plan_notes_global_batches_larger_than_the_data_set(tmp_path: Path, write_jsonl, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = write_jsonl(tmp_path / "mixed.jsonl", records(24))
    argv = ["plan", "--cost-model", MODEL, "--data", str(data), "--gpus", "8", "--batches", "1", "-o", "p.json"]
    assert main(argv + ["--global-batch", "16"]) == 0
    assert "samples repeat" not in capsys.readouterr().out
    assert main(argv + ["--global-batch", "64"]) == 0
    assert "note: a global batch of up to 64 samples is drawn from 24: samples repeat" in capsys.readouterr().out
