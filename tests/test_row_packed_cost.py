"""Packed rows whose attention spans the whole row: RowPackedCost, the plugins' choice of it, and
the split it gives."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from dflop_ds.compose import attends_per_sample, resolve_cost_model
from dflop_ds.config import DFLOPConfig
from dflop_ds.cost import (
    FittedCostModel,
    Microbatches,
    PackedCost,
    PositionalCostModel,
    RowPackedCost,
    StageCost,
    cost_model_from_dict,
    cost_model_to_dict,
    microbatch_cost_by_position,
)
from dflop_ds.cost.packed import ROW_LENGTH_BLOCK
from dflop_ds.schedule.splitters import SplitRequest, make_splitter
from dflop_ds.shapes import SampleShape
from dflop_ds.sync import SyncModel
from tests.test_costmodel import shape as cost_shape
from tests.test_costmodel import synthetic_profile, true_llm


@pytest.fixture(scope="module")
def fitted() -> FittedCostModel:
    return FittedCostModel().fit(synthetic_profile())


def test_a_row_costs_the_llm_one_sequence_of_all_its_tokens_and_the_encoder_each_sample(fitted):
    row, packed = RowPackedCost(fitted), PackedCost(fitted)
    shapes = [cost_shape(2, 100), cost_shape(0, 300), cost_shape(5, 90)]
    costs = row.predict_microbatch(shapes)
    np.testing.assert_allclose(costs[0], packed.predict_microbatch(shapes)[0])  # the encoder as packed
    whole = SampleShape("whole", text_tokens=490, llm_tokens=490)
    np.testing.assert_allclose(costs[1], fitted.predict_samples([whole])[0, 1])
    np.testing.assert_allclose(costs[1], sum(true_llm(1, 490)), rtol=0.02)  # the generating curve at S=490
    assert costs[1] > packed.predict_microbatch(shapes)[1] * 1.05  # the row's attention over 490^2, not a sum
    assert not row.additive and packed.additive
    one = [cost_shape(3, 200)]  # a one-sample row is just that sample
    np.testing.assert_allclose(row.predict_microbatch(one), packed.predict_microbatch(one), rtol=1e-6)


def test_many_rows_at_once_match_one_at_a_time_and_an_empty_row_costs_nothing(fitted):
    row = RowPackedCost(fitted)
    shapes = [cost_shape(t, s) for t, s in [(1, 80), (0, 400), (4, 60), (0, 30), (2, 250)]]
    groups = [[0, 1], [], [2, 3, 4], [1]]
    batched = row.predict_microbatches(Microbatches.of(shapes, groups))
    one_by_one = [row.predict_microbatch([shapes[i] for i in g]) for g in groups]
    np.testing.assert_allclose(batched, one_by_one)
    assert not batched[1].any()


class _CacheThatMustNotBeWalked(dict):
    def __iter__(self):
        raise AssertionError("the row-length cache was walked")

    def keys(self):
        raise AssertionError("the row-length cache was walked")


def test_each_row_length_is_predicted_once_and_looked_up_without_walking_the_cache(fitted, monkeypatch):
    """A splitter costs thousands of rows per global batch and the cache holds every row length of
    the run: a lookup that walked it (``set(lengths) - cache.keys()``) made a 16-sample split four
    times slower and grew with the run."""
    row = RowPackedCost(fitted)
    row._rows = _CacheThatMustNotBeWalked({n: float(n) for n in range(1000, 5000)})
    asked: list[int] = []
    predict = fitted.predict_samples
    monkeypatch.setattr(
        fitted, "predict_samples", lambda shapes: asked.extend(s.llm_tokens for s in shapes) or predict(shapes)
    )
    first = row.row_llm(np.array([300, 120, 300, 1500]))
    asked_first = len(asked)
    again = row.row_llm(np.array([120, 300, 7]))
    assert len(asked) == asked_first
    # the blocks of the new lengths in one call, each length once; 1500 was cached
    assert asked == sorted({*range(1, ROW_LENGTH_BLOCK), *range(2 * ROW_LENGTH_BLOCK, 3 * ROW_LENGTH_BLOCK)})
    np.testing.assert_allclose(first, [first[0], first[1], first[0], 1500.0])
    np.testing.assert_allclose(
        again, [first[1], first[0], fitted.predict_samples([SampleShape("r", text_tokens=7, llm_tokens=7)])[0, 1]]
    )


def test_rows_costed_by_position_match_rows_costed_by_shapes_for_positional_and_other_models(fitted):
    """A splitter costs a batch's rows by positions: RowPackedCost looks each sample up once for the
    batch (no shape hashed per row); any other model is asked with the row's shapes. Both give the
    row's cost, and the sampler uses the positional form, corrected costs included."""
    shapes = [cost_shape(t, s, f"s{i}") for i, (t, s) in enumerate([(1, 180), (0, 400), (4, 600), (0, 30), (2, 250)])]
    rows = [[0, 1], [2, 3, 4], (4, 0), [3], []]
    row, packed = RowPackedCost(fitted), PackedCost(fitted)
    assert isinstance(row, PositionalCostModel) and not isinstance(fitted, PositionalCostModel)

    def row_by_shapes(group):  # the encoder as packed, the LLM one sequence of all the tokens
        tokens = sum(s.llm_tokens for s in group)
        llm = fitted.predict_samples([SampleShape("whole", text_tokens=tokens, llm_tokens=tokens)])[0, 1]
        return np.array([packed.predict_microbatch(group)[0], llm])

    for model, by_shapes in ((row, row_by_shapes), (fitted, fitted.predict_microbatch)):
        by_position = microbatch_cost_by_position(model, shapes)
        for positions in rows:
            expected = by_shapes([shapes[p] for p in positions]) if positions else np.zeros(2)
            np.testing.assert_allclose(by_position(positions), expected, rtol=1e-9, err_msg=str(positions))

    from dflop_ds.schedule.sampler import SamplerSettings, make_sampler

    sampler = make_sampler(
        SamplerSettings("dflop"), shapes * 2, global_batch_size=4, gradient_accumulation_steps=2, cost_model=row
    )
    batch, pair = np.array([1, 6, 2, 9]), [shapes[1], shapes[2]]
    expected = row_by_shapes(pair)

    def refused(_shapes):
        raise AssertionError("the sampler costed a row by its shapes")

    row.predict_microbatch = refused  # the sampler's rows must come from the positional form
    cost = sampler.split_request(batch, sampler.costs[batch], 0).microbatch_cost
    np.testing.assert_allclose(cost([0, 2]), expected, rtol=1e-9)
    # with costs a runtime correction adjusted, each column scales by the row's adjusted / base cost
    sampler.cost_adjuster = SimpleNamespace(replaces_columns=False)
    adjusted = sampler.costs[batch] * np.array([[2.0, 1.0], [1.0, 1.0], [1.0, 3.0], [1.0, 1.0]])
    corrected = sampler.split_request(batch, adjusted, 0).microbatch_cost
    scale = adjusted[[0, 2]].sum(axis=0) / sampler.costs[batch][[0, 2]].sum(axis=0)
    np.testing.assert_allclose(corrected([0, 2]), expected * scale, rtol=1e-9)
    sampler.cost_adjuster = SimpleNamespace(replaces_columns=True)  # other columns: the rows' sum
    assert sampler.split_request(batch, adjusted, 0).microbatch_cost is None


def test_row_packed_models_are_saved_as_their_kind_and_per_stage_models_are_refused(fitted):
    row = RowPackedCost(fitted)
    loaded = cost_model_from_dict(cost_model_to_dict(row))
    assert type(loaded) is RowPackedCost
    shapes = [cost_shape(2, 100), cost_shape(1, 220)]
    np.testing.assert_allclose(loaded.predict_microbatch(shapes), row.predict_microbatch(shapes))
    with pytest.raises(ValueError, match="per pipeline stage"):
        RowPackedCost(StageCost(fitted, np.array([[1.0, 0.5], [0.0, 0.5]])))


def packed_request(model, shapes: list[SampleShape]) -> SplitRequest:
    """A ZeRO-3 request for ``shapes`` (3 microbatches on 2 ranks) costed by ``model``."""
    cost = None if model.additive else (lambda rows: model.predict_microbatch([shapes[r] for r in rows]))
    costs = np.asarray(model.predict_samples(shapes))
    rows = list(range(len(shapes)))
    return SplitRequest(rows, costs, 3, 2, shapes=shapes, microbatch_cost=cost, sync=SyncModel.MODULE)


def test_the_split_under_row_attention_keeps_rows_even_where_the_additive_split_does_not(fitted):
    """Text-only samples: the additive packed cost cannot tell one long row from two short ones, the
    row cost can. On four batches, DFLOP's split with the row cost has rows of more even length and a
    shorter step under the row cost than its split with the additive one (each no longer, 2% shorter
    in the mean: the synthetic profile's attention is a small part of its LLM cost)."""
    row, packed = RowPackedCost(fitted), PackedCost(fitted)
    ratios = []
    for seed in range(4):
        lengths = [int(n) for n in np.random.default_rng(seed).integers(20, 400, 24)]
        shapes = [SampleShape(f"s{i}", text_tokens=n, llm_tokens=n) for i, n in enumerate(lengths)]

        truth, steps, spreads = packed_request(row, shapes), {}, {}
        for name, model in (("row", row), ("packed", packed)):
            split = make_splitter("dflop").split(packed_request(model, shapes)).ranks
            steps[name] = truth.step(truth.predict(split))
            tokens = [sum(lengths[i] for i in mb) for rank in split for mb in rank]
            spreads[name] = max(tokens) - min(tokens)
        assert steps["row"] <= steps["packed"] and spreads["row"] < spreads["packed"], (seed, steps, spreads)
        ratios.append(steps["row"] / steps["packed"])
    assert np.mean(ratios) < 0.985, ratios


def test_the_sampler_gives_the_splitter_lengths_only_for_padded_microbatches(fitted):
    """Lengths drive the padding-aware starts (samples of like length together): right for padded
    microbatches, wrong for packed rows, whose cost is not additive either."""
    from dflop_ds.schedule.sampler import SamplerSettings, make_sampler

    shapes = [cost_shape(i % 3, 40 + 25 * i, f"s{i}") for i in range(16)]
    batch = np.arange(8)
    for model, padded in ((fitted, True), (PackedCost(fitted), False), (RowPackedCost(fitted), False)):
        sampler = make_sampler(
            SamplerSettings("dflop"), shapes, global_batch_size=8, gradient_accumulation_steps=2, cost_model=model
        )
        request = sampler.split_request(batch, sampler.costs[batch], 0)
        assert (request.lengths is not None) is padded, type(model).__name__
        assert (request.microbatch_cost is None) is model.additive


def test_flash_attention_keeps_a_padding_free_rows_samples_apart_and_sdpa_does_not():
    def model(impl, nested=False):
        text = SimpleNamespace(_attn_implementation=impl)
        config = SimpleNamespace(get_text_config=lambda: text) if nested else text
        return SimpleNamespace(config=config)

    assert attends_per_sample(model("flash_attention_2")) and attends_per_sample(model("flash_attention_3", True))
    assert not attends_per_sample(model("sdpa")) and not attends_per_sample(model("eager", True))
    assert not attends_per_sample(SimpleNamespace())  # no config: not known to keep samples apart


def test_llamafactory_packing_balances_on_the_row_cost_and_padding_free_without_it_on_the_additive_one():
    from transformers import Trainer

    from dflop_ds.integrations.llamafactory import dflop_trainer_class

    trainer = SimpleNamespace(dflop_settings=DFLOPConfig(), shape_policy=None, model=None)
    assert isinstance(dflop_trainer_class(Trainer, packing=True)._dflop_cost_model(trainer), RowPackedCost)
    assert dflop_trainer_class(Trainer, packing=False)._dflop_cost_model(trainer) is None  # padded: the proxy
    plain = resolve_cost_model(DFLOPConfig(), None, None, padding_free=True)
    assert type(plain) is PackedCost
