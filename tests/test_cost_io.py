"""The cost package: every cost model satisfies the protocol and round-trips through the one file format."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dflop_ds.cost import (
    AnalyticMLLM,
    CostModel,
    FittedCostModel,
    PackedCost,
    ProxyCost,
    cost_model_to_dict,
    load_cost_model,
    reference_model,
    save_cost_model,
)
from dflop_ds.shapes import SampleShape
from tests.test_costmodel import synthetic_profile

SHAPES = [
    SampleShape("text", encoder_tiles=0, llm_tokens=40, text_tokens=40),
    SampleShape("image", encoder_tiles=5, llm_tokens=110, text_tokens=30),
    SampleShape("video", encoder_tiles=32, llm_tokens=560, text_tokens=48),
]


def models() -> dict[str, CostModel]:
    fitted = FittedCostModel().fit(synthetic_profile())
    return {
        "fitted": fitted,
        "analytic": reference_model("llava-ov-0.5b-a100"),
        "proxy": ProxyCost(tile_cost=9.0, encoder_bytes_per_tile=1e6),
        "packed-fitted": PackedCost(fitted),
        "packed-proxy": PackedCost(ProxyCost()),
    }


@pytest.mark.parametrize("name", sorted(models()))
def test_every_cost_model_meets_the_protocol_and_round_trips(name, tmp_path):
    model = models()[name]
    assert isinstance(model, CostModel)
    samples, microbatch, memory = (
        model.predict_samples(SHAPES),
        model.predict_microbatch(SHAPES),
        model.predict_memory(SHAPES),
    )
    assert samples.shape == (3, 2) and microbatch.shape == (2,) and memory.shape == (2,)
    assert (samples >= 0).all() and (memory > 0).all()
    assert memory.sum() > np.sum(model.predict_memory(SHAPES[:1])), "more samples, more memory"
    path = tmp_path / f"{name}.json"
    save_cost_model(model, path)
    loaded = load_cost_model(path)
    assert type(loaded) is type(model) and json.loads(path.read_text())["format_version"] == 3
    for method in ("predict_samples", "predict_microbatch", "predict_memory"):
        np.testing.assert_array_equal(getattr(loaded, method)(SHAPES), getattr(model, method)(SHAPES))
    assert cost_model_to_dict(loaded) == cost_model_to_dict(model)


def test_reference_names_load_and_other_objects_do_not_save(tmp_path):
    assert isinstance(load_cost_model("llava-ov-7b-h100"), AnalyticMLLM)
    with pytest.raises(FileNotFoundError, match="neither a file nor a reference profile"):
        load_cost_model(str(tmp_path / "missing.json"))
    with pytest.raises(TypeError, match="cannot save a object"):
        save_cost_model(object(), tmp_path / "x.json")  # type: ignore[arg-type]


def test_packed_memory_is_additive_beyond_one_constant():
    packed = PackedCost(FittedCostModel().fit(synthetic_profile()))
    alone = np.array([packed.predict_memory([s]) for s in SHAPES])
    constant = alone.sum(axis=0) - packed.predict_memory(SHAPES)
    assert (constant >= 0).all()
    np.testing.assert_allclose(packed.predict_memory(SHAPES[:2]), alone[:2].sum(axis=0) - constant / 2)


@pytest.mark.parametrize(
    "part, key, value, message",
    [
        ("gpu", "mfu", float("nan"), r"gpu A100-80GB\.mfu must be a finite number above 0 and at most 1, got nan"),
        ("gpu", "peak_flops", -1.0, r"peak_flops must be a finite number above 0, got -1\.0"),
        ("gpu", "memory_bytes", 0, r"memory_bytes must be a finite number above 0, got 0"),
        ("llm", "layers", 0, r"qwen2-0\.5b\.layers must be a whole count >= 1, got 0"),
        ("llm", "hidden", "896", r"hidden must be a whole count >= 1, got '896'"),
        (None, "tokens_per_tile", float("nan"), r"tokens_per_tile must be a whole count >= 1, got nan"),
    ],
)
def test_an_analytic_cost_model_with_a_size_outside_its_meaning_is_refused_naming_file_and_key(
    tmp_path, part, key, value, message
):
    """NaN, zero or negative sizes gave "no plan fits" (exit 0), a ZeroDivisionError or a cost error naming nothing."""
    path = tmp_path / "model.json"
    save_cost_model(load_cost_model("llava-ov-0.5b-a100"), path)
    data = json.loads(path.read_text())
    (data["state"] if part is None else data["state"][part])[key] = value
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=rf"{path}: malformed analytic cost model, ValueError: .*{message}"):
        load_cost_model(str(path))
