"""The pieces of `make gpu-check` that decide its verdicts: time budgets, gradient comparison, the last line.

The script itself runs on a lent GPU or by hand (`make gpu-check`); CI does not run it.
"""

from __future__ import annotations

import time

import pytest
import torch

from benchmarks.gpu_check import PartTimeout, gradient_error, summary_line, time_limit


def test_time_limit_interrupts_and_nests() -> None:
    with pytest.raises(PartTimeout):
        with time_limit(0.2):
            time.sleep(2)
    # an inner limit longer than the outer one still ends at the outer one
    started = time.monotonic()
    with pytest.raises(PartTimeout):
        with time_limit(0.3):
            with time_limit(5):
                time.sleep(2)
    assert time.monotonic() - started < 1.5
    # a block that ends in time leaves no alarm behind
    with time_limit(0.2):
        pass
    time.sleep(0.3)


def test_gradient_error_ignores_noise_of_zero_gradients_only() -> None:
    reference = {"w": torch.tensor([1.0, -2.0]), "k_bias": torch.tensor([1e-11, 0.0])}
    noisy = {"w": torch.tensor([1.0, -2.0]), "k_bias": torch.tensor([-2e-11, 3e-11])}
    assert gradient_error(noisy, reference) < 1e-6
    wrong = {"w": torch.tensor([1.0, -1.0]), "k_bias": reference["k_bias"]}
    assert gradient_error(wrong, reference) == pytest.approx(0.5)
    with pytest.raises(AssertionError, match="different parameters"):
        gradient_error({"w": reference["w"]}, reference)


def test_summary_line_counts_parts_and_marks_missing_figures() -> None:
    parts = {"env": {"ok": True}, "packed": {"ok": True}, "profile": {"ok": False}}
    line = summary_line("cpu", parts, {"packed_rel_err": 3.2e-7})
    assert line == "gpu-check device=cpu parts_ok=2/3 packed_rel_err=3.200e-07 microbatch_mape=n/a speedup_vs_stock=n/a"
