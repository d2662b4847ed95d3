"""The tiny builders' ``width``: wider hidden sizes and more heads, the same layers and head size,
and the widened models still train a step (the benchmarks' models, `make bench-frameworks`)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForImageTextToText

from dflop_ds.testing.hf_tiny import ENCODER_HEAVY_VISION, WIDTH_KEYS, build_encoder_heavy_llava, widened
from dflop_ds.testing.qwen2_vl_tiny import build_tiny_qwen2_vl


def test_widened_scales_only_the_named_keys():
    sizes = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 3}
    assert widened(sizes, 3, WIDTH_KEYS) == {"hidden_size": 192, "num_attention_heads": 12, "num_hidden_layers": 3}
    assert widened(sizes, 1, WIDTH_KEYS) == sizes
    with pytest.raises(ValueError, match="width must be a positive integer, not 0"):
        widened(sizes, 0, WIDTH_KEYS)


def head_size(config) -> int:
    return config.hidden_size // config.num_attention_heads


def test_a_wider_encoder_heavy_llava_keeps_its_layers_and_head_size_and_trains(tmp_path):
    narrow = AutoConfig.from_pretrained(build_encoder_heavy_llava(tmp_path / "w1"))
    model_dir = build_encoder_heavy_llava(tmp_path / "w2", width=2)
    wide = AutoConfig.from_pretrained(model_dir)
    assert wide.vision_config.hidden_size == 2 * ENCODER_HEAVY_VISION["hidden_size"]
    for part in ("vision_config", "text_config"):
        n, w = getattr(narrow, part), getattr(wide, part)
        assert w.hidden_size == 2 * n.hidden_size and w.intermediate_size == 2 * n.intermediate_size
        assert w.num_hidden_layers == n.num_hidden_layers and head_size(w) == head_size(n)
    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    side = wide.vision_config.image_size
    tokens = (side // wide.vision_config.patch_size) ** 2
    ids = torch.cat([torch.full((1, tokens), wide.image_token_id), torch.arange(5, 13).view(1, -1)], dim=1)
    out = model(input_ids=ids, pixel_values=torch.randn(1, 3, side, side), labels=ids)
    out.loss.backward()
    tower = model.model.vision_tower.encoder.layers
    assert torch.isfinite(out.loss) and all(p.grad is not None and p.grad.any() for p in tower.parameters())


def test_a_wider_qwen2_vl_keeps_its_rotary_head_size(tmp_path):
    narrow = AutoConfig.from_pretrained(build_tiny_qwen2_vl(tmp_path / "w1"))
    wide = AutoConfig.from_pretrained(build_tiny_qwen2_vl(tmp_path / "w4", width=4))
    assert wide.text_config.hidden_size == 4 * narrow.text_config.hidden_size
    assert wide.vision_config.hidden_size == wide.text_config.hidden_size  # the merger feeds the LLM
    assert wide.vision_config.embed_dim == 4 * narrow.vision_config.embed_dim
    assert head_size(wide.text_config) == head_size(narrow.text_config)  # M-RoPE's sections fit the head
    assert wide.vision_config.embed_dim // wide.vision_config.num_heads == (
        narrow.vision_config.embed_dim // narrow.vision_config.num_heads
    )


def test_the_encoder_heavy_qwen2_vl_widens_its_tower_alone_and_trains(tmp_path):
    from dflop_ds.testing.qwen2_vl_tiny import ENCODER_HEAVY_VISION_WIDTH

    narrow = AutoConfig.from_pretrained(build_tiny_qwen2_vl(tmp_path / "plain", width=2))
    model_dir = build_tiny_qwen2_vl(tmp_path / "heavy", width=2, encoder_heavy=True)
    heavy = AutoConfig.from_pretrained(model_dir)
    assert heavy.vision_config.embed_dim == ENCODER_HEAVY_VISION_WIDTH * narrow.vision_config.embed_dim
    assert heavy.vision_config.depth == narrow.vision_config.depth
    assert heavy.vision_config.embed_dim // heavy.vision_config.num_heads == (
        narrow.vision_config.embed_dim // narrow.vision_config.num_heads
    )
    assert heavy.text_config.to_dict() == narrow.text_config.to_dict()  # the LLM as the plain model's
    assert heavy.vision_config.hidden_size == heavy.text_config.hidden_size
    tower = AutoModelForImageTextToText.from_pretrained(model_dir).model.visual
    grid = torch.tensor([[1, 4, 4]])  # one image of 4 x 4 patches: 2 x 2 merged tokens
    patch = heavy.vision_config
    pixels = torch.randn(16, 3 * patch.temporal_patch_size * patch.patch_size**2)
    out = tower(pixels, grid_thw=grid)
    features = getattr(out, "pooler_output", out)  # the merged tokens the LLM gets
    assert features.shape == (4, heavy.text_config.hidden_size)
    features.square().mean().backward()
    assert all(p.grad is not None and p.grad.any() for p in tower.blocks.parameters())
