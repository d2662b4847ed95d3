"""The colocated (dispatched) encoder of an HF LLaVA on the plain engine: ZeRO-2 dp2 and DeepSpeed
AutoTP tp2 (and tp2 with the local encoder) against the local encoder's unsharded dp2 run, in one
2-rank launch. The training loop's tp2 colocated run is tests/test_autotp.py's end-to-end test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ds_runs import run_on_ranks

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_colocated_dispatch_hf_zero2_and_autotp_tp2_train_like_the_local_encoder(tmp_path):
    from dflop_ds.testing.hf_tiny import build_tiny_llava
    from dflop_ds.testing.llava_data import write_llava_dataset

    model = build_tiny_llava(tmp_path / "model", vision="clip", text="llama")
    data, images = write_llava_dataset(tmp_path / "data", 24, seed=3)
    out = tmp_path / "report.json"
    args = ["--model", model, "--data", data, "--images", images, "--out", out]
    run_on_ranks(ROOT / "tests" / "ds_scripts" / "hf_colocated_autotp_check.py", args, timeout=900)
    report = json.loads(out.read_text())
    reference = report["local"]
    for name in ("colocated", "autotp", "autotp_local"):
        run = report[name]
        assert run["samples"] == reference["samples"], f"{name} trained other global batches"
        if name != "autotp_local":
            assert run["foreign_tiles"] > 0, f"{name}: no tile was encoded away from its owner: the test proves nothing"
        assert run["losses"] == pytest.approx(reference["losses"], rel=1e-5), (name, run["losses"])
        # SGD: a parameter differs by lr x the gradient difference; the encoder apart, since a
        # gradient counted once per tensor-parallel rank would show there first
        assert max(run["max_param_diff"]) < 1e-4 * run["max_param_change"], (name, run)
        assert max(run["max_encoder_diff"]) < 1e-4 * run["max_encoder_change"], (name, run)
        assert run["max_encoder_change"] > 1e-4  # the encoder trains
    assert reference["losses"][-1] < reference["losses"][0]
