"""Tests of the tiny MLLM layers and its synthetic dataset/collate."""

from __future__ import annotations

import pytest
import torch

from dflop_ds.models import (
    IGNORE_INDEX,
    LMHead,
    PatchEmbed,
    Projector,
    TinyMLLMConfig,
    TinyMLLMDataset,
    build_reference,
    collate_microbatch,
    label_tokens_in,
    microbatch_denominator,
    supervised_count,
    tiny_mllm_layers,
)
from dflop_ds.models.tiny import merged_positions, sinusoidal_positions
from dflop_ds.pipe.loss import token_normalized_loss
from dflop_ds.schedule.index import ScheduledIndex
from dflop_ds.shapes import TINY_POLICY, SampleShape

torch.set_num_threads(1)

SMALL = TinyMLLMConfig(vision_layers=1, llm_layers=2, vision_dim=32, llm_dim=64, vocab_size=128)


def shape(name: str, tiles_images=(), text: int = 8, labels: int | None = None, frames: int = 0):
    return TINY_POLICY.shape(name, image_sizes=tiles_images, video_frames=frames, text_tokens=text, label_tokens=labels)


ONE_TILE = ((336, 336),)
THREE_TILES = ((672, 336),)


@pytest.fixture(scope="module")
def model() -> torch.nn.Sequential:
    return build_reference(SMALL, seed=5).eval()


def test_config_matches_tiny_policy_and_validates() -> None:
    config = TinyMLLMConfig()
    assert config.patches_per_tile == 64
    assert config.tokens_per_tile == TINY_POLICY.tokens_per_tile == 16
    with pytest.raises(ValueError, match="patch_size"):
        TinyMLLMConfig(image_size=30)
    with pytest.raises(ValueError, match="heads"):
        TinyMLLMConfig(llm_dim=100, llm_heads=3)


def test_layer_output_shapes(model: torch.nn.Sequential) -> None:
    ds = TinyMLLMDataset([shape("a", THREE_TILES, text=5), shape("b", text=9), shape("c", ONE_TILE, text=2)], SMALL)
    (pixels, ids, text_lens, tiles), (targets, _) = collate_microbatch([ds[0], ds[1], ds[2]])
    assert pixels.shape == (4, 3, 32, 32) and tiles.tolist() == [3, 0, 1]
    vis = model[0]((pixels, ids, text_lens, tiles))
    assert vis[0].shape == (4, 64, SMALL.vision_dim)
    hidden, seq_lens = model[2](model[1](vis))
    assert seq_lens.tolist() == [3 * 16 + 5, 9, 16 + 2]
    assert hidden.shape == (3, 53, SMALL.llm_dim) == (*targets.shape, SMALL.llm_dim)
    logits = model((pixels, ids, text_lens, tiles))
    assert logits.shape == (3, 53, SMALL.vocab_size)


def test_merge_puts_each_samples_tiles_before_its_text() -> None:
    text_lens = torch.tensor([2, 3])
    tiles = torch.tensor([1, 0])
    visual, text, seq_lens, s = merged_positions(text_lens, tiles, tokens_per_tile=2)
    assert s == 4 and seq_lens.tolist() == [4, 3]
    assert visual.tolist() == [0, 1]  # sample 0, positions 0..1
    assert text.tolist() == [2, 3, 4, 5, 6]  # sample 0 at 2..3, sample 1 at row 1 (offset 4) 0..2


def test_projector_merge_content(model: torch.nn.Sequential) -> None:
    projector: Projector = model[2]
    vis = torch.randn(3, SMALL.patches_per_tile, SMALL.vision_dim)
    ids = torch.tensor([[5, 6, 0], [7, 8, 9]])
    hidden, seq_lens = projector((vis, ids, torch.tensor([2, 3]), torch.tensor([2, 1])))
    pos = sinusoidal_positions(hidden.shape[1], SMALL.llm_dim, hidden.device, hidden.dtype)
    visual = projector.mlp(projector.norm(projector.pool(vis))).reshape(-1, SMALL.llm_dim)
    text = projector.embed(ids)
    torch.testing.assert_close(hidden[0, :32] - pos[:32], visual[:32])
    torch.testing.assert_close(hidden[0, 32:34] - pos[32:34], text[0, :2])
    torch.testing.assert_close(hidden[1, :16] - pos[:16], visual[32:])
    torch.testing.assert_close(hidden[1, 16:19] - pos[16:19], text[1])
    assert torch.all(hidden[0, 34:] == 0) and seq_lens.tolist() == [34, 19]
    with pytest.raises(ValueError, match="tiles_per_sample"):
        projector((vis, ids, torch.tensor([2, 3]), torch.tensor([1, 1])))


def test_causal_masking_later_token_does_not_change_earlier_logits(model: torch.nn.Sequential) -> None:
    ds = TinyMLLMDataset([shape("a", ONE_TILE, text=10)], SMALL, seed=1)
    inputs, _ = collate_microbatch([ds[0]])
    pixels, ids, text_lens, tiles = inputs
    changed = ids.clone()
    changed[0, 6] = (changed[0, 6] + 1) % SMALL.vocab_size
    with torch.no_grad():
        a = model(inputs)
        b = model((pixels, changed, text_lens, tiles))
    position = 16 + 6  # the changed token's merged position
    torch.testing.assert_close(a[:, :position], b[:, :position])
    assert not torch.allclose(a[:, position:], b[:, position:])


def test_padding_does_not_change_results(model: torch.nn.Sequential) -> None:
    shapes = [shape("short", ONE_TILE, text=4), shape("long", THREE_TILES, text=20), shape("txt", text=7)]
    ds = TinyMLLMDataset(shapes, SMALL)
    with torch.no_grad():
        together = model(collate_microbatch([ds[0], ds[1], ds[2]])[0])
        for b in range(3):
            alone = model(collate_microbatch([ds[b]])[0])
            n = alone.shape[1]
            torch.testing.assert_close(together[b, :n], alone[0], atol=1e-5, rtol=1e-5)


def test_zero_tile_microbatch_runs_forward_and_backward() -> None:
    model = build_reference(SMALL, seed=2)
    ds = TinyMLLMDataset([shape("t1", text=6), shape("t2", text=9, labels=3)], SMALL)
    inputs, (targets, denom) = collate_microbatch([ds[0], ds[1]])
    assert inputs[0].shape == (0, 3, 32, 32) and inputs[3].tolist() == [0, 0]
    vis = model[1](model[0](inputs))[0]
    assert vis.shape == (0, SMALL.patches_per_tile, SMALL.vision_dim)
    assert vis.grad_fn is not None  # a trainable encoder keeps grad history even with no tiles
    logits = model(inputs)
    assert logits.shape == (2, 9, SMALL.vocab_size)
    token_normalized_loss(logits, (targets, denom)).backward()
    assert model[0].proj.weight.grad is not None and float(model[0].proj.weight.grad.abs().sum()) == 0.0
    assert float(model[-1].proj.weight.grad.abs().sum()) > 0


def test_frozen_encoder_gets_no_grads() -> None:
    model = build_reference(SMALL, seed=3)
    n_encoder = 1 + SMALL.vision_layers
    for i in range(n_encoder):
        model[i].requires_grad_(False)
    ds = TinyMLLMDataset([shape("a", THREE_TILES, text=8), shape("b", text=5)], SMALL)
    inputs, labels = collate_microbatch([ds[0], ds[1]])
    token_normalized_loss(model(inputs), labels).backward()
    for i, layer in enumerate(model):
        grads = [p.grad for p in layer.parameters()]
        if i < n_encoder:
            assert all(g is None for g in grads), f"frozen layer {i} got a gradient"
        else:
            assert all(g is not None for g in grads), f"layer {i} missed a gradient"


def test_layer_specs_and_modules_have_identical_weights() -> None:
    encoder, projector, llm = tiny_mllm_layers(SMALL, seed=9, as_specs=True)
    assert len(encoder) == 1 + SMALL.vision_layers and len(llm) == SMALL.llm_layers + 1
    assert isinstance(llm[-1].build(), LMHead) and isinstance(encoder[0].build(), PatchEmbed)
    built = [spec.build() for spec in [*encoder, projector, *llm]]
    reference = build_reference(SMALL, seed=9)
    for i, (a, b) in enumerate(zip(built, reference)):
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            assert torch.equal(p, q), f"layer {i} {name} differs"
    other = build_reference(SMALL, seed=10)
    assert not torch.equal(other[3].block.attn.qkv.weight, reference[3].block.attn.qkv.weight)


# ----------------------------------------------------------------------------- dataset


def test_items_have_exactly_the_shape_and_are_deterministic() -> None:
    shapes = [
        shape("img", THREE_TILES, text=12, labels=5),
        shape("vid", frames=3, text=7),
        shape("txt", text=4, labels=2),
    ]
    ds = TinyMLLMDataset(shapes, SMALL, seed=4)
    for i, s in enumerate(shapes):
        item = ds[i]
        assert item.pixels.shape == (s.encoder_tiles, 3, 32, 32)
        assert item.input_ids.shape == (s.text_tokens,)
        assert item.targets.shape == (s.encoder_tiles * 16 + s.text_tokens,)
        assert int((item.targets != IGNORE_INDEX).sum()) == s.label_tokens == supervised_count(s)
        again = TinyMLLMDataset(shapes, SMALL, seed=4)[i]
        assert torch.equal(item.pixels, again.pixels) and torch.equal(item.input_ids, again.input_ids)
    assert not torch.equal(TinyMLLMDataset(shapes, SMALL, seed=5)[0].input_ids, ds[0].input_ids)
    assert all(0 < t < SMALL.vocab_size for t in ds[0].input_ids.tolist())


def test_targets_are_shifted_answer_tokens() -> None:
    ds = TinyMLLMDataset([shape("img", ONE_TILE, text=6, labels=2)], SMALL)
    item = ds[0]
    # the last two text tokens (merged positions 20, 21) are predicted at positions 19, 20
    expected = torch.full((22,), IGNORE_INDEX)
    expected[19], expected[20] = item.input_ids[4], item.input_ids[5]
    assert torch.equal(item.targets, expected)


def test_all_text_supervised_uses_last_visual_position_or_clamps() -> None:
    ds = TinyMLLMDataset([shape("img", ONE_TILE, text=5, labels=5), shape("txt", text=5, labels=5)], SMALL)
    image_item, text_item = ds[0], ds[1]
    assert int(image_item.targets[15]) == int(image_item.input_ids[0])  # last visual position
    assert label_tokens_in([image_item]) == 5
    assert label_tokens_in([text_item]) == 4 == supervised_count(ds.shapes[1])  # documented clamp


def test_scheduled_index_denominator_reaches_the_collate() -> None:
    ds = TinyMLLMDataset([shape("a", ONE_TILE, text=6, labels=3), shape("b", text=8, labels=4)], SMALL)
    _, (targets, denom) = collate_microbatch([ds[ScheduledIndex(0, 2.5)], ds[ScheduledIndex(1, 2.5)]])
    assert float(denom) == 2.5 and targets.shape == (2, 22)
    _, (_, own) = collate_microbatch([ds[0], ds[1]])
    assert float(own) == 7.0 == label_tokens_in([ds[0], ds[1]])
    with pytest.raises(ValueError, match="mixes loss denominators"):
        microbatch_denominator([ds[ScheduledIndex(0, 2.5)], ds[1]])
    with pytest.raises(ValueError, match="mixes loss denominators"):
        microbatch_denominator([ds[ScheduledIndex(0, 2.5)], ds[ScheduledIndex(1, 3.0)]])


def test_dataset_errors_name_the_sample() -> None:
    with pytest.raises(ValueError, match="'empty'"):
        TinyMLLMDataset([SampleShape("empty")], SMALL)
    ds = TinyMLLMDataset([shape("a", text=3)], SMALL)
    with pytest.raises(IndexError, match="out of range"):
        ds[1]
    with pytest.raises(ValueError, match="empty microbatch"):
        collate_microbatch([])
