"""The colocated (dispatched, data parallel over all ranks) encoder beside DeepSpeed's pipeline engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflop_ds.launch import run_deepspeed

ROOT = Path(__file__).resolve().parent.parent


def check_colocated_pipeline_matches_in_pipeline_encoder(tmp_path: Path, ranks: int) -> None:
    """Both modes: same losses and parameters after every SGD step as the encoder on stage 0."""
    out = tmp_path / "report.json"
    result = run_deepspeed(ROOT / "tests" / "ds_scripts" / "tiny_colocated_pipe_check.py", ["--out", str(out)],
                           ranks=ranks, cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    for mode in ("trainable", "frozen"):
        run = report[mode]
        assert run["foreign_tiles"] > 0, "no tile was encoded away from its owner: the test proves nothing"
        assert run["losses_colocated"] == pytest.approx(run["losses_local"], rel=1e-5)
        # SGD: parameters after each step differ by lr * (gradient difference)
        assert max(run["max_param_diff"]) < 1e-5 * max(run["max_param_change"], 1e-3), run
        assert len(run["samples"]) == len(set(run["samples"]))  # every sample of the steps once
    assert report["trainable"]["encoder_change_colocated"] > 1e-4
    assert report["frozen"]["encoder_change_colocated"] == 0.0


@pytest.mark.slow
def test_colocated_dispatch_pp2_matches_in_pipeline_encoder_losses_and_gradients(tmp_path):
    check_colocated_pipeline_matches_in_pipeline_encoder(tmp_path, ranks=2)


@pytest.mark.slow
def test_colocated_dispatch_pp2_dp2_four_ranks_matches_in_pipeline_encoder(tmp_path):
    check_colocated_pipeline_matches_in_pipeline_encoder(tmp_path, ranks=4)
