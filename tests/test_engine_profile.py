"""Engine profile: fitting the engine's own costs from measured steps, its file, and the simulation."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dflop_ds.plan.engine_profile import (
    EngineProfile,
    EngineStep,
    fit_compute_scale,
    fit_engine_profile,
    read_engine_steps,
)
from dflop_ds.plan.simulator import simulate_1f1b
from dflop_ds.shapes import SampleShape

SHARES = np.array([[1.0, 0.25], [0.0, 0.75]])  # stage 0: the encoder and a quarter of the LLM


def truth() -> EngineProfile:
    return EngineProfile(
        compute_scale=[1.3, 1.1], forward_fraction=0.36, load_s=[0.002, 0.001], tail_s=[0.006, 0.04], exchange_s=0.003
    )


def measured_steps(profile: EngineProfile, n_steps: int = 6, n_mb: int = 8, seed: int = 0) -> list[EngineStep]:
    """Steps as a run with exactly ``profile``'s engine would measure them."""
    rng = np.random.default_rng(seed)
    steps = []
    for _ in range(n_steps):
        costs = rng.uniform(0.005, 0.08, (n_mb, 2))
        compute = profile.stage_seconds(costs, SHARES)
        ff = profile.forward_fraction
        totals = {
            "forward": ff * compute.sum(0),
            "backward": (1 - ff) * compute.sum(0),
            "load": np.array(profile.load_s) * n_mb,
            "reduce": np.zeros(2),
            "optimizer": np.array(profile.tail_s),
        }
        steps.append(EngineStep(costs, compute, totals, profile.simulate(costs, SHARES).step_time))
    return steps


def test_fit_recovers_the_engine_that_produced_the_steps() -> None:
    fitted = fit_engine_profile(measured_steps(truth()), SHARES)
    np.testing.assert_allclose(fitted.compute_scale, truth().compute_scale, rtol=1e-6)
    assert fitted.forward_fraction == pytest.approx(0.36)
    np.testing.assert_allclose(fitted.load_s, truth().load_s)
    np.testing.assert_allclose(fitted.tail_s, truth().tail_s)
    assert fitted.exchange_s == pytest.approx(0.003, rel=1e-3)


def test_the_fitted_profile_predicts_steps_it_never_saw() -> None:
    fitted = fit_engine_profile(measured_steps(truth(), seed=1), SHARES)
    for step in measured_steps(truth(), seed=2):
        assert fitted.simulate(step.costs, SHARES).step_time == pytest.approx(step.step_s, rel=1e-3)


def test_exchange_is_zero_when_the_run_was_faster_than_its_compute() -> None:
    steps = measured_steps(truth())
    for step in steps:
        step.step_s *= 0.5
    assert fit_engine_profile(steps, SHARES).exchange_s == 0.0


def test_an_unused_segment_keeps_scale_one() -> None:
    steps = measured_steps(truth())
    for step in steps:
        step.costs[:, 0] = 0.0
        step.compute = 1.1 * step.costs @ SHARES.T
    assert fit_compute_scale(steps, SHARES) == pytest.approx([1.0, 1.1])


def test_more_stages_map_first_middle_last() -> None:
    profile = EngineProfile([1, 1], 0.3, [0.002, 0.0, 0.0, 0.001], [0.01, 0.02, 0.04, 0.05], 0.0)
    np.testing.assert_allclose(profile.per_stage(profile.tail_s, 3), [0.01, 0.03, 0.05])
    np.testing.assert_allclose(profile.per_stage(profile.tail_s, 5), [0.01, 0.03, 0.03, 0.03, 0.05])
    # middle stages never load microbatches
    costs = np.full((4, 2), 0.01)
    shares = np.full((3, 2), 1 / 3)
    sim = profile.simulate(costs, shares)
    assert sim.busy[0, 1] == pytest.approx(4 * 0.02 / 3 * 1.0)
    assert sim.busy[0, 0] == pytest.approx(4 * (0.02 / 3 + 0.002))


def test_the_profile_adds_what_the_cost_model_leaves_out() -> None:
    costs = np.full((4, 2), 0.02)
    plain = simulate_1f1b(costs @ SHARES.T / 3, 2 * costs @ SHARES.T / 3).step_time
    assert truth().simulate(costs, SHARES).step_time > plain * 1.2


def test_file_round_trip_and_errors_name_the_file(tmp_path) -> None:
    path = tmp_path / "engine.json"
    truth().save(path)
    assert EngineProfile.load(path).to_dict() == truth().to_dict()
    data = json.loads(path.read_text())
    del data["exchange_s"]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"engine\.json.*exchange_s"):
        EngineProfile.load(path)
    path.write_text(json.dumps({"format": "dflop-ds-costmodel"}))
    with pytest.raises(ValueError, match="not an engine profile"):
        EngineProfile.load(path)


class _FlatCost:
    encoder_layers, llm_layers, layer_shares = 5, 5, None

    def predict_microbatch(self, shapes):
        return np.array([0.001 * sum(s.encoder_tiles for s in shapes), 0.0001 * max(s.llm_tokens for s in shapes)])


def _record(step: int, microbatches: list[list[int]]) -> dict:
    n = len(microbatches)
    return {
        "step": step,
        "step_s": 1.0,
        "microbatches": [microbatches],
        "mb_observed": [[0.1] * n, [0.2] * n],
        "stage_totals_s": {"forward": [0.3, 0.6], "backward": [0.5, 1.0], "load": [0.01, 0.01]},
        "stage_bounds": [0, 7, 11],
    }


def test_reading_telemetry_names_the_line_at_fault(tmp_path) -> None:
    shapes = [SampleShape(sample_id=str(i), encoder_tiles=2, llm_tokens=40, text_tokens=8) for i in range(4)]
    log = tmp_path / "telemetry.jsonl"
    good = _record(3, [[0, 1], [2], [3]])
    log.write_text(json.dumps(_record(0, [[0]])) + "\n" + json.dumps(good) + "\n")
    steps, bounds = read_engine_steps(log, shapes, _FlatCost())
    assert bounds == [0, 7, 11] and len(steps) == 1
    assert steps[0].compute.shape == (3, 2) and steps[0].costs[0] == pytest.approx([0.004, 0.004])
    bad = dict(good)
    del bad["stage_totals_s"]
    log.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match=r"telemetry\.jsonl:2.*stage_totals_s"):
        read_engine_steps(log, shapes, _FlatCost())
    log.write_text(json.dumps(_record(4, [[0, 9]])) + "\n")
    with pytest.raises(ValueError, match=r"telemetry\.jsonl:1.*outside the dataset of 4"):
        read_engine_steps(log, shapes, _FlatCost())
    log.write_text(json.dumps(_record(0, [[0]])) + "\n")
    with pytest.raises(ValueError, match="no telemetry record after"):
        read_engine_steps(log, shapes, _FlatCost())
