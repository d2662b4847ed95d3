"""A tiny random HF Qwen3-VL model directory, built offline, for tests and demos: the model (two of its
three vision blocks feed deepstack features to the first two decoder layers), the tiny BPE tokenizer
of :mod:`~dflop_ds.testing.hf_tiny` with Qwen3-VL's special tokens, and its image processor (the one
Qwen3-VL's processor uses, with tiny patches; no processor class: its video processor wants torchvision)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from dflop_ds.testing.hf_tiny import TEXT_SIZES, VISION_LAYERS, copied
from dflop_ds.testing.patch_grid_tiny import (
    MERGE,
    PATCH,
    build_patch_grid_tokenizer,
    patch_grid_image_processor,
    save_seeded,
    special_token_ids,
    vision_token_ids,
)


@cache
def _built_qwen3_vl(tie_word_embeddings: bool, seed: int, deepstack: tuple[int, ...]) -> Path:
    """Build and save one tiny Qwen3-VL directory in a process-wide temporary folder (cached)."""
    import transformers

    tokenizer = build_patch_grid_tokenizer()
    vision = dict(
        depth=VISION_LAYERS,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=TEXT_SIZES["hidden_size"],
        patch_size=PATCH,
        spatial_merge_size=MERGE,
        temporal_patch_size=2,
        num_position_embeddings=16,  # a 4 x 4 learned table, resampled to every image's grid
        deepstack_visual_indexes=list(deepstack),
    )
    # head_dim 16: the rotary half (8 frequencies) interleaved over (temporal, height, width)
    text = dict(
        vocab_size=len(tokenizer),
        **TEXT_SIZES,
        head_dim=16,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [2, 3, 3],
            "mrope_interleaved": True,
        },
        **special_token_ids(tokenizer),
    )
    config = transformers.Qwen3VLConfig(
        vision_config=vision,
        text_config=text,
        **vision_token_ids(tokenizer),
        tie_word_embeddings=tie_word_embeddings,
    )
    image_processor = patch_grid_image_processor(image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    model_class = transformers.Qwen3VLForConditionalGeneration
    return save_seeded("tiny_qwen3_vl_", model_class, config, seed, tokenizer, image_processor)


def build_tiny_qwen3_vl(
    dir: str | Path, *, tie_word_embeddings: bool = False, seed: int = 0, deepstack: tuple[int, ...] = (0, 1)
) -> Path:
    """Write a tiny random Qwen3-VL model, its tokenizer and its image processor to ``dir``
    (``save_pretrained`` layout); returns ``dir``. ``deepstack``: the vision blocks whose features
    are added to the first decoder layers (``deepstack_visual_indexes``). Images keep their own size
    within 64..1024 pixels (multiples of ``patch x merge`` = 8 px): every image gives its own grid."""
    return copied(_built_qwen3_vl(bool(tie_word_embeddings), int(seed), tuple(int(i) for i in deepstack)), dir)


__all__ = ["build_tiny_qwen3_vl"]
