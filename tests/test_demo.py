"""`make demo`'s figures: interleaved rounds, median with min-max, r per pipeline stage."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def demo():
    spec = importlib.util.spec_from_file_location("demo", ROOT / "examples" / "demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_output(median_step: float, predicted: np.ndarray, observed: np.ndarray, warmup: int = 1) -> dict:
    """A run's summary JSON as examples/train.py writes it: ``predicted[step]`` is (n_mb, stages),
    ``observed[step]`` (stages, n_mb); the first ``warmup`` steps are not timed."""
    steps = [
        {"step": i, "telemetry": {"predicted_space": "stage", "mb_predicted": p.tolist(), "mb_observed": o.tolist()}}
        for i, (p, o) in enumerate(zip(predicted, observed))
    ]
    summary = {
        "steps": len(steps) - warmup,
        "median_step_s": median_step,
        "samples_per_s": 32 / median_step,
        "tokens_per_s": 1.0,
        "imbalance_encoder": 1.1,
        "imbalance_llm": 1.2,
        "padding_efficiency": 1.0,
        "first_loss": 6.0,
        "last_loss": 3.0,
    }
    return {"summary": summary, "steps": steps}


def test_rounds_rotate_the_method_order(demo):
    assert [demo.rotated(("stock", "dflop"), r) for r in range(3)] == [
        ["stock", "dflop"],
        ["dflop", "stock"],
        ["stock", "dflop"],
    ]


def test_r_per_stage_pairs_each_stage_with_its_column_and_skips_warmup(demo):
    rng = np.random.default_rng(0)
    predicted = rng.uniform(0.01, 0.1, size=(4, 8, 2))
    observed = np.stack([2.0 * predicted[:, :, 0], 3.0 * predicted[:, :, 1]], axis=1)  # exact per stage
    observed[1, 1] = rng.uniform(0.01, 0.3, size=8)  # stage 1 noise in one step
    observed[0] = rng.uniform(0.01, 0.3, size=(2, 8))  # a warm-up step: pure noise, not counted
    telemetry = demo.timed_telemetry(run_output(1.0, predicted, observed))
    assert len(telemetry) == 3
    r = demo.stage_correlations(telemetry)
    assert r[0] == pytest.approx(1.0)
    assert r[1] < 0.99
    swapped = np.stack([2.0 * predicted[:, :, 1], 3.0 * predicted[:, :, 0]], axis=1)
    r_swapped = demo.stage_correlations(demo.timed_telemetry(run_output(1.0, predicted, swapped)))
    assert r_swapped[0] < 0.9 and r_swapped[1] < 0.9  # not a match with the other stage's column


def test_speedup_per_round_and_table_show_median_and_range(demo):
    predicted = np.full((2, 4, 2), 0.05)
    observed = np.full((2, 2, 4), 0.1)
    runs = {
        "stock": [run_output(s, predicted, observed) for s in (1.2, 1.5, 1.3)],
        "dflop": [run_output(d, predicted, observed) for d in (1.0, 1.0, 1.3)],
    }
    assert demo.speedups(runs) == pytest.approx([1.2, 1.5, 1.0])
    text = demo.table(runs)
    assert "1.300 (1.200-1.500)" in text and "1.000 (1.000-1.300)" in text
    lines = demo.correlation_lines(runs)
    assert len(lines) == 3 and "nan" in lines[0]  # constant predictions: no correlation to report


def test_correlation_lines_add_cpu_time_where_the_runs_measured_it(demo):
    rng = np.random.default_rng(1)
    predicted = rng.uniform(0.01, 0.1, size=(3, 4, 2))
    wall = rng.uniform(0.01, 0.3, size=(3, 2, 4))  # noise
    runs = {m: [run_output(1.0, predicted, wall)] for m in ("stock", "dflop")}
    for output in runs["stock"] + runs["dflop"]:
        for step, p in zip(output["steps"], predicted):
            step["telemetry"]["mb_observed_cpu"] = (2.0 * p.T).tolist()  # exactly proportional
    lines = demo.correlation_lines(runs)
    cpu = [line for line in lines if "(CPU time)" in line]
    assert len(lines) == 6 and len(cpu) == 3
    assert all("r=1.000" in line for line in cpu) and not any("r=1.000" in line for line in lines if line not in cpu)
    assert demo.variation(np.array([1.0, 3.0])) == pytest.approx(0.5)


def test_the_demo_compares_its_figure_with_the_readmes_row(demo):
    row = "| `make demo` | x1.64 samples/s (3 runs: x1.40-1.69) | stock sampler | 23 Nov, CPU machine |"
    assert demo.readme_figure(f"# dflop-ds\n\n{row}\n") == (
        1.64,
        "x1.64 samples/s (3 runs: x1.40-1.69), 23 Nov, CPU machine",
    )
    line = demo.comparison_line(1.5, row)
    assert line.startswith("README.md says x1.64 samples/s") and "this run x1.500 (-8.5% against it)" in line
    assert "no `make demo` row" in demo.comparison_line(1.5, "no table")
    assert demo.readme_figure((ROOT / "README.md").read_text()) is not None  # the repository's own README has it
