"""Many microbatches predicted in one call (:mod:`dflop_ds.cost.batched`) equal the
per-microbatch predictions, for every cost model and wrapper, and for a model that declares no
batched form."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from dflop_ds.cost import (
    BatchedCostModel,
    BatchedPlannerCostModel,
    EncoderScaled,
    EngineScaled,
    FittedCostModel,
    LLMOnlyCost,
    Microbatches,
    PackedCost,
    PackedView,
    PlannerCostModel,
    PlannerView,
    ProxyCost,
    StageCost,
    microbatch_activation_bytes,
    microbatch_costs,
    microbatch_working_bytes,
    reference_model,
)
from dflop_ds.shapes import SampleShape
from tests.test_costmodel import synthetic_profile

SHARES = np.array([[1.0, 0.25], [0.0, 0.5], [0.0, 0.25]])


def random_batch(seed: int, n: int = 40) -> tuple[list[SampleShape], list[list[int]]]:
    """``n`` random shapes (some text-only) and random microbatches of them, one of them empty."""
    rng = np.random.default_rng(seed)
    shapes = []
    for i in range(n):
        tiles = int(rng.integers(0, 12)) if rng.random() < 0.7 else 0
        text = int(rng.integers(1, 3000))
        visual = 30 * tiles
        shapes.append(
            SampleShape(
                f"s{i}",
                encoder_tiles=tiles,
                visual_tokens=visual,
                text_tokens=text,
                llm_tokens=visual + text,
                encoder_attention=int(tiles * rng.integers(0, 900)),
            )
        )
    positions = rng.permutation(n).tolist() + rng.integers(0, n, size=10).tolist()  # some samples twice
    cuts = sorted(rng.choice(np.arange(1, len(positions)), size=8, replace=False).tolist())
    groups = [positions[a:b] for a, b in zip([0, *cuts], [*cuts, len(positions)])]
    return shapes, groups[:3] + [[]] + groups[3:]


def windowed_fitted() -> FittedCostModel:
    """A fitted model whose encoder time also depends on attention units (``1, T, A``)."""
    profile = synthetic_profile()
    for point in profile.encoder:
        point.attention_units = point.tiles**2
        point.time_s = 2e-3 + 1e-3 * point.tiles + 5e-5 * point.tiles**2
    return FittedCostModel().fit(profile)


class Unbatched:
    """A planner model of someone else's: per-microbatch predictions only (no batched form)."""

    def __init__(self) -> None:
        self.inner = reference_model("llava-ov-0.5b-a100")

    def __getattr__(self, name: str) -> object:  # the inner model's attributes, not its batched predictions
        if name.startswith("predict_microbatches"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    def predict_microbatch(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        return self.inner.predict_microbatch(shapes) * 2.0

    def predict_activation_bytes(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        return self.inner.predict_activation_bytes(shapes) + 1.0

    def predict_working_bytes(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        return self.inner.predict_working_bytes(shapes) * 3.0


@pytest.fixture(scope="module")
def fitted() -> FittedCostModel:
    return FittedCostModel().fit(synthetic_profile())


def models(fitted: FittedCostModel) -> dict[str, object]:
    analytic = reference_model("llava-ov-7b-h100")
    return {
        "analytic": analytic,
        "fitted": fitted,
        "fitted-windows": windowed_fitted(),
        "proxy": ProxyCost(),
        "packed-analytic": PackedCost(analytic),
        "packed-fitted": PackedCost(fitted),
        "packed-proxy": PackedCost(ProxyCost()),
        "llm-only": LLMOnlyCost(fitted),
        "stage": StageCost(analytic, SHARES),
        "stage-packed-llm-only": StageCost(PackedCost(LLMOnlyCost(fitted)), SHARES),
        "view": PlannerView(fitted),
        "packed-view": PackedView(analytic),
        "encoder-scaled": EncoderScaled(analytic, 2.5),
        "engine-scaled-packed": EngineScaled(PackedView(fitted), [1.5, 1.2], forward_fraction=0.4),
        "unbatched": Unbatched(),
        "view-of-unbatched": EncoderScaled(Unbatched(), 0.5),  # type: ignore[arg-type]
    }


def per_microbatch(predict, shapes: list[SampleShape], groups: list[list[int]]) -> np.ndarray:
    return np.array([np.asarray(predict([shapes[i] for i in g]), dtype=float).reshape(-1) for g in groups])


@pytest.mark.parametrize("seed", [0, 1])
def test_batched_predictions_equal_the_per_microbatch_ones(fitted, seed):
    shapes, groups = random_batch(seed)
    batch = Microbatches.of(shapes, groups)
    assert batch.sizes[3] == 0 and len(batch) == len(groups)
    for name, model in models(fitted).items():
        expected = per_microbatch(model.predict_microbatch, shapes, groups)
        assert expected[:, -1].max() > 0, name
        np.testing.assert_allclose(microbatch_costs(model, batch), expected, rtol=1e-12, atol=0, err_msg=name)
        if not isinstance(model, PlannerCostModel):  # the bytes are a planner model's
            continue
        for batched, single in (
            (microbatch_activation_bytes, model.predict_activation_bytes),
            (microbatch_working_bytes, model.predict_working_bytes),
        ):
            expected = per_microbatch(single, shapes, groups)
            np.testing.assert_allclose(batched(model, batch), expected, rtol=1e-12, atol=0, err_msg=name)


def test_the_analytic_model_is_exact_and_declares_its_batched_form(fitted):
    """The planner's choices rest on these: its integer sums give the very same floats."""
    shapes, groups = random_batch(2, n=200)
    analytic = reference_model("llava-ov-7b-h100")
    batch = Microbatches.of(shapes, groups)
    for batched, single in (
        (microbatch_costs, analytic.predict_microbatch),
        (microbatch_activation_bytes, analytic.predict_activation_bytes),
        (microbatch_working_bytes, analytic.predict_working_bytes),
    ):
        np.testing.assert_array_equal(batched(analytic, batch), per_microbatch(single, shapes, groups))
    for model in models(fitted).values():
        assert isinstance(model, BatchedCostModel) != isinstance(model, Unbatched)
    assert isinstance(PackedView(analytic), BatchedPlannerCostModel)
    assert not isinstance(PackedCost(analytic), BatchedPlannerCostModel), "it predicts no planner bytes"


def test_microbatch_sums_and_maxima_skip_empty_microbatches():
    shapes, _ = random_batch(3, n=6)
    tiles = np.array([s.encoder_tiles for s in shapes])
    batch = Microbatches.of(shapes, [[], [0, 1], [], [], [2], [5, 3, 4], []])
    np.testing.assert_array_equal(batch.sums(tiles), [0, tiles[:2].sum(), 0, 0, tiles[2], tiles[3:].sum(), 0])
    np.testing.assert_array_equal(batch.maxima(tiles)[[0, 2, 3, 6]], 0)
    nothing = Microbatches.of(shapes, [])
    assert len(nothing) == 0 and microbatch_costs(ProxyCost(), nothing).size == 0
    singles = Microbatches.singletons(shapes)
    np.testing.assert_array_equal(singles.sums(tiles), tiles)


def test_every_cost_class_that_changes_a_prediction_changes_its_batched_form():
    """A class of dflop_ds.cost that defines a per-microbatch prediction defines its batched form
    beside it: a view inheriting only the batched form would forward its inner model's rows."""
    import importlib
    import inspect
    import pkgutil

    import dflop_ds.cost as cost

    pairs = (
        ("predict_microbatch", "predict_microbatches"),
        ("predict_activation_bytes", "predict_microbatches_activation_bytes"),
        ("predict_working_bytes", "predict_microbatches_working_bytes"),
    )
    modules = [importlib.import_module(f"dflop_ds.cost.{m.name}") for m in pkgutil.iter_modules(cost.__path__)]
    classes = [
        klass
        for module in modules
        if module is not cost.protocol
        for _, klass in inspect.getmembers(module, inspect.isclass)
        if klass.__module__ == module.__name__
    ]
    checked = 0
    for klass in classes:
        for single, batched in pairs:
            if single in vars(klass):
                checked += 1
                assert batched in vars(klass), f"{klass.__name__} defines {single} but not {batched}"
    assert checked >= 13 and "ColumnScaled" in {k.__name__ for k in classes}  # unexported ones too
