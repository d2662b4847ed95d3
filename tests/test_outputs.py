"""Output paths are checked before long work; a folder given as a cost model is named as such."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from dflop_ds.commands.main import main as cli_main
from dflop_ds.paths import OutputPathError, check_writable, check_writable_folder

ROOT = Path(__file__).resolve().parent.parent
DATA = str(ROOT / "examples" / "data" / "mixture.jsonl")


def plan_8_gpus(cost_model: str, output: Path) -> int:
    """``dflop-ds plan`` of the example mixture on 8 GPUs (global batch 32) with ``cost_model``
    written to ``output``: its exit code."""
    return cli_main(
        ["plan", "--gpus", "8", "--global-batch", "32", "--cost-model", cost_model, "--data", DATA, "-o", str(output)]
    )


def test_check_writable_names_the_option_and_leaves_files_alone(tmp_path):
    existing = tmp_path / "log.jsonl"
    existing.write_text("kept\n")
    assert check_writable(existing, "--telemetry") == existing and existing.read_text() == "kept\n"
    assert check_writable(tmp_path / "new" / "deeper" / "out.json", "-o").parent.is_dir()
    assert not (tmp_path / "new" / "deeper" / "out.json").exists()
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(OutputPathError, match=r"--telemetry .*a_file/x\.jsonl: cannot be written"):
        check_writable(blocker / "x.jsonl", "--telemetry")
    with pytest.raises(OutputPathError, match="is a folder"):
        check_writable(tmp_path, "-o")


def test_plan_refuses_an_unwritable_output_before_searching(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    start = time.monotonic()
    code = plan_8_gpus("llava-ov-0.5b-a100", blocker / "plan.json")
    assert code == 1 and time.monotonic() - start < 5
    assert "plan -o" in capsys.readouterr().err


def test_plan_names_a_folder_given_as_cost_model(tmp_path, capsys):
    code = plan_8_gpus(str(tmp_path), tmp_path / "plan.json")
    assert code == 1
    err = capsys.readouterr().err
    assert f"{tmp_path}: is a folder, expected a JSON file" in err and "Traceback" not in err


def test_an_output_folder_is_checked_as_a_folder(tmp_path):
    assert check_writable_folder(tmp_path / "new" / "trained", "--output_dir").is_dir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputPathError, match="--output_dir .*is a file"):
        check_writable_folder(tmp_path / "file", "--output_dir")
