"""Packed microbatches of the tiny model: the same losses and gradients as the padded ones."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from dflop_ds.config import DFLOPConfig
from dflop_ds.cost import FittedCostModel, PackedCost
from dflop_ds.models import TinyMLLMConfig, TinyMLLMDataset, build_reference, collate_microbatch
from dflop_ds.models.packing import join_rows, segment_causal_attention, segment_positions, token_positions
from dflop_ds.models.source import tiny_source
from dflop_ds.pipe.loss import token_normalized_loss
from dflop_ds.schedule.sampler import SamplerSettings, make_sampler
from dflop_ds.shapes import TINY_POLICY
from dflop_ds.train.options import build_parser
from tests.test_costmodel import shape as cost_shape
from tests.test_costmodel import synthetic_profile, true_encoder, true_llm

torch.set_num_threads(1)

SMALL = TinyMLLMConfig(vision_layers=1, llm_layers=2, vision_dim=32, llm_dim=64, vocab_size=128)


def shape(name: str, images=(), text: int = 8, labels: int | None = None):
    return TINY_POLICY.shape(name, image_sizes=images, video_frames=0, text_tokens=text, label_tokens=labels)


SHAPES = [
    shape("one-tile", ((336, 336),), text=5, labels=3),
    shape("text", text=23, labels=9),
    shape("three-tiles", ((672, 336),), text=11, labels=11),
    shape("short", text=3, labels=2),
]


def loss_and_grads(model: torch.nn.Module, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    inputs, labels = batch
    loss = token_normalized_loss(model(inputs), labels)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def test_segment_positions_restart_per_run() -> None:
    segment, offset = segment_positions(torch.tensor([2, 0, 3]))
    assert segment.tolist() == [0, 0, 2, 2, 2] and offset.tolist() == [0, 1, 0, 1, 2]


def test_rows_join_padded_or_packed_and_positions_restart_per_sample() -> None:
    rows = [torch.tensor([1, 2, 3]), torch.tensor([4]), torch.tensor([5, 6])]
    assert join_rows(rows, -1, packed=False).tolist() == [[1, 2, 3], [4, -1, -1], [5, 6, -1]]
    assert join_rows(rows, -1, packed=True).tolist() == [[1, 2, 3, 4, 5, 6]]
    lens = torch.tensor([3, 1, 2])
    assert token_positions(lens, 3, 3).tolist() == [[0, 1, 2]] * 3
    assert token_positions(lens, 1, 6).tolist() == [[0, 1, 2, 0, 0, 1]]
    with pytest.raises(ValueError, match="one row of sum"):
        token_positions(lens, 1, 5)


@pytest.mark.parametrize("kv_heads,window", [(4, None), (2, None), (2, 3)], ids=["mha", "gqa", "gqa-window"])
def test_segment_attention_equals_a_dense_per_sample_mask(kv_heads: int, window: int | None) -> None:
    """One SDPA per sample equals SDPA over the packed row with the (N x N) mask of each sample's
    causal (sliding-window) attention, with grouped key/value heads and a custom scale."""
    torch.manual_seed(0)
    lengths, heads = [5, 1, 7], 4
    n = sum(lengths)
    q = torch.randn(1, heads, n, 8)
    k, v = torch.randn(1, kv_heads, n, 8), torch.randn(1, kv_heads, n, 8)
    segment, offset = segment_positions(torch.tensor(lengths))
    distance = offset[:, None] - offset[None, :]
    mask = (segment[:, None] == segment[None, :]) & (distance >= 0) & (distance < (window or n))
    repeat = heads // kv_heads
    dense = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1), attn_mask=mask, scale=0.3
    )
    torch.testing.assert_close(segment_causal_attention(q, k, v, lengths, scale=0.3, window=window), dense)


def test_packed_collate_is_one_row_of_the_padded_contents() -> None:
    ds = TinyMLLMDataset(SHAPES, SMALL)
    items = [ds[i] for i in range(len(SHAPES))]
    (pix_p, ids_p, text_p, tiles_p), (tgt_p, den_p) = collate_microbatch(items, packed=True)
    (pix, ids, text, tiles), (tgt, den) = collate_microbatch(items)
    assert torch.equal(pix_p, pix) and torch.equal(text_p, text) and torch.equal(tiles_p, tiles)
    assert ids_p.shape == (1, int(text.sum())) and tgt_p.shape == (1, sum(s.llm_tokens for s in SHAPES))
    assert torch.equal(ids_p[0], ids[torch.arange(ids.shape[1])[None, :] < text[:, None]])
    assert torch.equal(tgt_p[tgt_p != -100], tgt[tgt != -100]) and float(den_p) == float(den)


def test_packed_loss_and_gradients_equal_the_padded_ones() -> None:
    model = build_reference(SMALL, seed=3)
    ds = TinyMLLMDataset(SHAPES, SMALL, seed=1)
    items = [ds[i] for i in range(len(SHAPES))]
    padded_loss, padded_grads = loss_and_grads(model, collate_microbatch(items))
    packed_loss, packed_grads = loss_and_grads(model, collate_microbatch(items, packed=True))
    torch.testing.assert_close(packed_loss, padded_loss, atol=1e-6, rtol=1e-5)
    assert padded_grads.keys() == packed_grads.keys()
    for name, grad in padded_grads.items():
        torch.testing.assert_close(
            packed_grads[name], grad, atol=1e-6, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}"
        )


def test_packed_logits_of_a_sample_do_not_depend_on_its_neighbours() -> None:
    model = build_reference(SMALL, seed=4).eval()
    ds = TinyMLLMDataset(SHAPES, SMALL)
    with torch.no_grad():
        together = model(collate_microbatch([ds[0], ds[1], ds[2]], packed=True)[0])
        swapped = model(collate_microbatch([ds[2], ds[1], ds[0]], packed=True)[0])
        alone = model(collate_microbatch([ds[1]])[0])
    n0, n1 = SHAPES[0].llm_tokens, SHAPES[1].llm_tokens
    n2 = SHAPES[2].llm_tokens
    torch.testing.assert_close(together[0, n0 : n0 + n1], alone[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(swapped[0, n2 : n2 + n1], alone[0], atol=1e-5, rtol=1e-5)


def test_a_packed_row_of_the_wrong_length_is_refused() -> None:
    model = build_reference(SMALL, seed=0)
    ds = TinyMLLMDataset(SHAPES[:2], SMALL)
    (pixels, ids, text_lens, tiles), _ = collate_microbatch([ds[0], ds[1]], packed=True)
    with pytest.raises(ValueError, match="packed"):
        model((pixels, ids[:, :-1], text_lens, tiles))


def test_packed_cost_is_the_overhead_plus_the_sum_of_the_samples() -> None:
    packed = PackedCost(FittedCostModel().fit(synthetic_profile()))
    np.testing.assert_allclose(packed.overhead_, [true_encoder(0), true_llm(0, 0)[0]], rtol=0.05)
    shapes = [cost_shape(2, 100), cost_shape(0, 300), cost_shape(5, 90)]
    per_sample = packed.predict_samples(shapes)
    np.testing.assert_allclose(packed.predict_microbatch(shapes), per_sample.sum(axis=0) + packed.overhead_)
    assert per_sample[1, 0] == 0.0  # a text-only sample costs the encoder nothing
    # the generating curves: one constant, the rest summed over samples (tiles; B, B*S, B*S^2 per sample)
    tokens = [100, 300, 90]
    llm = true_llm(0, 0)[0] + sum(sum(true_llm(1, s)) - true_llm(0, 0)[0] for s in tokens)
    np.testing.assert_allclose(packed.predict_microbatch(shapes), [true_encoder(7), llm], rtol=0.02)


def test_the_sampler_balances_packed_costs_additively() -> None:
    rng = np.random.default_rng(0)
    shapes = [
        cost_shape(int(t), int(16 * t + n), f"s{i}")
        for i, (t, n) in enumerate(zip(rng.integers(0, 6, 32), rng.integers(8, 600, 32)))
    ]
    packed = PackedCost(FittedCostModel().fit(synthetic_profile()))
    kwargs = dict(global_batch_size=16, gradient_accumulation_steps=4, cost_model=packed)
    dflop, stock = (make_sampler(SamplerSettings(method), shapes, **kwargs) for method in ("dflop", "stock"))
    assert dflop.additive and dflop._microbatch_cost(np.arange(16)) is None

    def makespan(sampler) -> float:
        split = sampler.schedule(0, 0, sampler.batches_in_epoch(0)[0]).split
        assert sorted(i for mb in split.ranks[0] for i in mb) == sorted(sampler.batches_in_epoch(0)[0].tolist())
        return max(float(packed.predict_microbatch([shapes[i] for i in mb]).max()) for mb in split.ranks[0])

    assert makespan(dflop) < makespan(stock)


def test_the_packing_switch_defaults_to_the_model_and_refuses_what_it_cannot_do() -> None:
    tiny = tiny_source({}, as_specs=False)
    assert tiny.uses_packing(None) and tiny.uses_packing(True) and not tiny.uses_packing(False)
    unpacked = dataclasses.replace(tiny, name="some-hf-model", packed_collate=None)
    assert not unpacked.uses_packing(None) and not unpacked.uses_packing(False)
    with pytest.raises(ValueError, match="some-hf-model"):
        unpacked.uses_packing(True)
    with pytest.raises(ValueError, match="packing"):
        DFLOPConfig.from_dict({"model": {"packing": "yes"}})
    assert DFLOPConfig.from_dict({"model": {"packing": False}}).model.packing is False
    parser = build_parser()
    assert parser.parse_args(["--deepspeed_config", "x", "--packing", "False"]).packing is False
    with pytest.raises(SystemExit):
        parser.parse_args(["--deepspeed_config", "x", "--packing", "maybe"])
