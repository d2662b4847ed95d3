"""The one chain of cost wrappers a sampler balances with (:func:`dflop_ds.cost.sampler_cost_model`)."""

from __future__ import annotations

import numpy as np
import pytest
from test_sampler_memory_cap import planted

from dflop_ds.cost import LLMOnlyCost, PackedCost, ProxyCost, StageCost, reference_model, sampler_cost_model

SHARES = np.array([[1.0, 0.25], [0.0, 0.75]])  # stage 0: the encoder and a quarter of the LLM


def chain(model) -> list[type]:
    """The wrapper classes of ``model``, outermost first, down to the innermost model."""
    kinds = [type(model)]
    while hasattr(model, "cost_model"):
        model = model.cost_model
        kinds.append(type(model))
    return kinds


def test_nothing_profiled_is_the_proxy_and_a_profiled_model_alone_is_itself() -> None:
    profiled = reference_model("llava-ov-7b-a100")
    assert chain(sampler_cost_model(None)) == [ProxyCost]
    assert sampler_cost_model(profiled) is profiled


@pytest.mark.parametrize(
    ("colocated", "packed", "corrected", "expected"),
    [
        (False, False, False, [StageCost]),
        (False, True, False, [StageCost, PackedCost]),
        (True, True, False, [PackedCost, LLMOnlyCost]),  # the colocated encoder leaves the pipeline's stages
        (False, True, True, [PackedCost]),  # a correction predicts per stage in its own columns
    ],
)
def test_the_wrappers_apply_in_one_order(colocated: bool, packed: bool, corrected: bool, expected: list[type]) -> None:
    profiled = reference_model("llava-ov-7b-a100")
    model = sampler_cost_model(
        profiled, colocated=colocated, packed=packed, stage_shares=lambda: SHARES, corrected=corrected, microbatches=4
    )
    assert chain(model) == [*expected, type(profiled)]


def test_the_proxy_gets_no_stage_columns_and_the_chain_predicts_what_its_parts_do() -> None:
    shapes = planted(16, 1)
    proxy = sampler_cost_model(None, packed=True, stage_shares=lambda: SHARES)
    assert chain(proxy) == [PackedCost, ProxyCost]  # no layer shares without a profile
    profiled = reference_model("llava-ov-7b-a100")
    staged = sampler_cost_model(profiled, packed=True, stage_shares=lambda: SHARES, microbatches=4)
    expected = PackedCost(profiled).predict_samples(shapes) @ SHARES.T
    np.testing.assert_allclose(staged.predict_samples(shapes), expected)
    colocated = sampler_cost_model(profiled, colocated=True, packed=True).predict_samples(shapes)
    np.testing.assert_allclose(colocated, LLMOnlyCost.drop_encoder(PackedCost(profiled).predict_samples(shapes)))
    assert colocated[:, 1].sum() > 0


def test_stage_shares_are_computed_only_when_the_chain_predicts_per_stage() -> None:
    def refuse() -> np.ndarray:
        raise AssertionError("stage shares computed for a chain that does not use them")

    sampler_cost_model(reference_model("llava-ov-7b-a100"), colocated=True, stage_shares=refuse)
    sampler_cost_model(None, stage_shares=refuse)
