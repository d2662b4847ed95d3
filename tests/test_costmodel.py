"""FittedCostModel: shapes of the fits, microbatch padding, JSON round trip, version refusal, CLI report."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflop_ds.commands.main import main as cli_main
from dflop_ds.cost import (
    FittedCostModel,
    Measurement,
    ModelProfile,
    ProxyCost,
    cost_model_to_dict,
    load_cost_model,
    save_cost_model,
)
from dflop_ds.cost.fit import MonotoneFit
from dflop_ds.shapes import SampleShape

TILES = (1, 2, 4, 8, 16, 32)
GRID = [(b, s) for b in (1, 2, 4) for s in (16, 64, 128, 256, 512)]


def true_encoder(t: float) -> float:
    return 2e-3 + 1.5e-3 * t


def true_llm(b: float, s: float) -> tuple[float, float]:
    """(linear part, attention part) seconds."""
    return 3e-3 + 7e-5 * b * s, 1e-7 * b * s * s


def synthetic_profile(noise: float = 0.0, seed: int = 0, peak: bool = True) -> ModelProfile:
    rng = np.random.default_rng(seed)

    def jitter() -> float:
        return float(1 + noise * rng.standard_normal())

    encoder = [
        Measurement(true_encoder(t) * jitter(), None, 1000 * t, 1200 * t if peak else None, tiles=t) for t in TILES
    ]
    llm = []
    for b, s in GRID:
        linear, attention = true_llm(b, s)
        acts = 500 * b * s + 4 * b * s * s
        llm.append(
            Measurement(
                (linear + attention) * jitter(),
                attention * jitter(),
                acts,
                acts + 64 if peak else None,
                batch=b,
                seq_len=s,
            )
        )
    return ModelProfile(
        encoder,
        llm,
        encoder_layers=6,
        llm_layers=5,
        param_bytes={"encoder": 10, "projector": 2, "llm": 30},
        hidden_bytes_per_token=512.0,
        meta={"scaling": ["synthetic"]},
    )


def shape(tiles: int, tokens: int, sample_id: str = "s") -> SampleShape:
    return SampleShape(
        sample_id, encoder_tiles=tiles, visual_tokens=16 * tiles, text_tokens=tokens - 16 * tiles, llm_tokens=tokens
    )


@pytest.fixture(scope="module")
def model() -> FittedCostModel:
    return FittedCostModel().fit(synthetic_profile())


def test_fit_recovers_the_generating_curves(model: FittedCostModel) -> None:
    tiles = np.array([3, 12, 40])
    assert model.encoder_time(tiles) == pytest.approx([true_encoder(t) for t in tiles], rel=1e-3)
    for b, s in [(3, 100), (1, 700), (4, 300)]:
        assert model.llm_time([b], [s])[0] == pytest.approx(sum(true_llm(b, s)), rel=1e-3)
        assert model.llm_attention_time([b], [s])[0] == pytest.approx(true_llm(b, s)[1], rel=1e-2)


def test_planner_attributes(model: FittedCostModel) -> None:
    assert model.encoder_layers == 6 and model.llm_layers == 5
    assert model.param_bytes == {"encoder": 10, "projector": 2, "llm": 30}
    assert model.hidden_bytes_per_token == 512.0
    assert model.is_analytic is False


@settings(max_examples=25, deadline=None)
@given(noise=st.floats(0.0, 0.6), seed=st.integers(0, 10_000))
def test_predictions_are_non_negative_and_monotone_even_on_noisy_data(noise: float, seed: int) -> None:
    fitted = FittedCostModel().fit(synthetic_profile(noise=noise, seed=seed))
    tiles = np.arange(0, 200)
    enc = fitted.encoder_time(tiles)
    assert np.all(enc >= 0) and np.all(np.diff(enc) >= 0)
    seq = np.arange(1, 2000, 7)
    for b in (1, 2, 3, 8):
        llm = fitted.llm_time(np.full_like(seq, b), seq)
        assert np.all(llm >= 0) and np.all(np.diff(llm) >= 0)
    per_batch = fitted.llm_time([1, 2, 3, 4, 5], [300] * 5)
    assert np.all(np.diff(per_batch) >= 0)
    mem = [fitted.predict_memory([shape(t, 16 * t + 50)]) for t in range(0, 30)]
    assert np.all(np.diff(np.array(mem), axis=0) >= 0) and np.all(np.array(mem) >= 0)


def test_predict_samples_shape_and_text_only_encoder_cost(model: FittedCostModel) -> None:
    shapes = [shape(0, 40, "text"), shape(4, 100, "image"), shape(8, 300, "video")]
    costs = model.predict_samples(shapes)
    assert costs.shape == (3, 2)
    assert costs[0, 0] == 0.0 and costs[1, 0] > 0 and costs[2, 0] > costs[1, 0]
    assert costs[2, 1] > costs[1, 1] > costs[0, 1] > 0
    assert model.predict_samples([]).shape == (0, 2)


def test_microbatch_cost_pads_to_the_longest_and_sums_tiles(model: FittedCostModel) -> None:
    long, short = shape(2, 500, "long"), shape(1, 40, "short")
    mixed = model.predict_microbatch([long, short, short, short])
    uniform = model.predict_microbatch([long] * 4)
    assert mixed[1] == pytest.approx(uniform[1])  # padding: three short ones cost as much as long ones
    assert mixed[1] == pytest.approx(model.llm_time([4], [500])[0])
    assert mixed[0] == pytest.approx(model.encoder_time([2 + 3])[0])  # encoder: total tiles
    packed = model.predict_samples([long, short, short, short])[:, 1].sum()
    assert mixed[1] > packed  # padding costs time that per-sample (packed) costs do not
    assert np.array_equal(model.predict_microbatch([]), np.zeros(2))


def test_memory_predictions(model: FittedCostModel) -> None:
    mb = [shape(4, 200), shape(2, 100)]
    acts = model.predict_activation_bytes(mb)
    assert acts.shape == (2,)
    assert acts[0] == pytest.approx(1000 * 6, rel=1e-6)
    assert acts[1] == pytest.approx(500 * 2 * 200 + 4 * 2 * 200**2, rel=1e-6)
    assert np.all(model.predict_memory(mb) >= acts)
    no_peak = FittedCostModel().fit(synthetic_profile(peak=False))
    assert no_peak.encoder_peak_ is None
    assert np.allclose(no_peak.predict_memory(mb), no_peak.predict_activation_bytes(mb))


def test_json_round_trip(model: FittedCostModel, tmp_path) -> None:
    path = tmp_path / "cm.json"
    save_cost_model(model, path)
    loaded = load_cost_model(path)
    shapes = [shape(t, 16 * t + 30 + 7 * t, f"s{t}") for t in range(0, 12)]
    assert np.array_equal(loaded.predict_samples(shapes), model.predict_samples(shapes))
    assert np.array_equal(loaded.predict_microbatch(shapes), model.predict_microbatch(shapes))
    assert np.array_equal(loaded.predict_memory(shapes), model.predict_memory(shapes))
    assert loaded.to_dict() == model.to_dict()
    assert loaded.llm_layers == model.llm_layers and loaded.param_bytes == model.param_bytes
    assert "pickle" not in path.read_text()


def test_refuses_a_file_of_another_version(model: FittedCostModel, tmp_path) -> None:
    data = cost_model_to_dict(model)
    data["format_version"] = 99
    path = tmp_path / "future.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"future\.json.*format_version 99.*re-run"):
        load_cost_model(path)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"format": "something-else", "format_version": 1}))
    with pytest.raises(ValueError, match="not a dflop-ds cost model"):
        load_cost_model(other)


def test_rejects_tampered_coefficients(model: FittedCostModel) -> None:
    data = model.to_dict()
    data["fits"]["encoder_time"]["coef"] = [-1.0, 1.0]
    with pytest.raises(ValueError, match="coefficients"):
        FittedCostModel.from_dict(data)


def test_unfitted_model_says_so() -> None:
    with pytest.raises(RuntimeError, match="not fitted"):
        FittedCostModel().predict_samples([shape(1, 20)])


def test_monotone_fit_ignores_an_outlier() -> None:
    x = np.arange(1, 11, dtype=float)
    y = 1.0 + 2.0 * x
    y[6] *= 3  # one timing spoiled by another process
    fit = MonotoneFit(("1", "T")).fit({"T": x}, y)
    assert fit.coef_ == pytest.approx([1.0, 2.0], rel=0.05)


def test_proxy_cost_has_the_same_interface(model: FittedCostModel) -> None:
    shapes = [shape(2, 60), shape(0, 30)]
    proxy = ProxyCost()
    assert proxy.predict_samples(shapes).shape == model.predict_samples(shapes).shape
    assert proxy.predict_microbatch(shapes).shape == model.predict_microbatch(shapes).shape


def test_report_cli_prints_the_table_and_writes_a_png(model: FittedCostModel, tmp_path, capsys) -> None:
    path, png = tmp_path / "cm.json", tmp_path / "fit.png"
    save_cost_model(model, path)
    assert cli_main(["profile", "report", str(path), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "encoder tiles" in out and "LLM batch x seq" in out and "fit error" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**cost_model_to_dict(model), "format_version": 0}))
    assert cli_main(["profile", "report", str(bad), "--png", ""]) == 1


def test_encoder_attention_units_follow_each_windows_patch_count() -> None:
    """A profile whose encoder points carry attention units (Qwen2-VL: an image attends within
    itself) fits ``1, T, A``; one large image then costs more than as many patches in small ones."""
    profile = synthetic_profile()
    for point in profile.encoder:
        point.attention_units = point.tiles**2
        point.time_s = 2e-3 + 1e-3 * point.tiles + 5e-5 * point.tiles**2
    model = FittedCostModel().fit(profile)
    assert model.encoder_features == ("1", "T", "A") and model.typical_window() > 0

    def image(sample_id: str, patches: int) -> SampleShape:
        return SampleShape(
            sample_id,
            encoder_tiles=patches,
            encoder_attention=patches**2,
            text_tokens=8,
            llm_tokens=8 + patches // 4,
            visual_tokens=patches // 4,
        )

    big = model.predict_microbatch([image("big", 32)])[0]
    small = model.predict_microbatch([image(f"s{i}", 8) for i in range(4)])[0]
    assert big == pytest.approx(2e-3 + 32e-3 + 5e-5 * 32**2, rel=0.02)
    assert small == pytest.approx(2e-3 + 32e-3 + 5e-5 * 4 * 8**2, rel=0.02)
    loaded = FittedCostModel.from_dict(json.loads(json.dumps(model.to_dict())))
    assert loaded.predict_microbatch([image("big", 32)])[0] == pytest.approx(big)
    assert FittedCostModel().fit(synthetic_profile()).encoder_features == ("1", "T")  # no attention units: as before
