"""A tiny random HF Qwen2-VL (or Qwen2.5-VL) model directory, built offline, for tests and demos:
the model, the tiny BPE tokenizer of :mod:`~dflop_ds.testing.hf_tiny` with Qwen2-VL's special tokens,
and its image processor (no processor class: Qwen2-VL's wants torchvision for videos)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from dflop_ds.testing.hf_tiny import TEXT_SIZES, VISION_LAYERS, WIDTH_KEYS, copied, widened
from dflop_ds.testing.patch_grid_tiny import (
    MAX_PIXELS,
    MERGE,
    MIN_PIXELS,
    PATCH,
    build_patch_grid_tokenizer,
    patch_grid_image_processor,
    save_seeded,
    special_token_ids,
    vision_token_ids,
)

QWEN2_VL_FAMILIES = ("qwen2_vl", "qwen2_5_vl")
#: how many times wider the encoder-heavy model's vision tower is (the same layers and head size):
#: 4x the compute per patch, about 3x the LLM's work per image token (each token is 2 x 2 merged
#: patches), as Qwen2-VL-2B's 675M-parameter ViT does about 2x its LLM's before attention over
#: each image's patches
ENCODER_HEAVY_VISION_WIDTH = 2


def _qwen2_vl_classes(family: str, vision: dict):
    """``(config class, model class, vision config)`` of a Qwen2-VL family with tiny ``vision`` sizes."""
    import transformers

    if family == "qwen2_vl":
        return transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration, vision
    if family == "qwen2_5_vl":
        # Qwen2.5-VL: gated MLP, 16 px attention windows (2 x 2 merge units), block 1 attends fully
        sizes = dict(
            vision,
            hidden_size=vision["embed_dim"],
            out_hidden_size=vision["hidden_size"],
            intermediate_size=64,
            window_size=16,
            fullatt_block_indexes=[1],
        )
        sizes.pop("embed_dim"), sizes.pop("mlp_ratio")
        return transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration, sizes
    raise ValueError(f"unknown Qwen2-VL family {family!r}; choose one of {QWEN2_VL_FAMILIES}")


@cache
def _built_qwen2_vl(
    family: str,
    tie_word_embeddings: bool,
    seed: int,
    min_pixels: int,
    max_pixels: int,
    patch_size: int,
    width: int,
    encoder_heavy: bool,
) -> Path:
    """Build and save one tiny Qwen2-VL directory in a process-wide temporary folder (cached)."""
    tokenizer = build_patch_grid_tokenizer()
    tower = dict(
        depth=VISION_LAYERS,
        embed_dim=32,
        hidden_size=64,
        mlp_ratio=2,
        num_heads=2,
        patch_size=patch_size,
        spatial_merge_size=MERGE,
        temporal_patch_size=2,
    )
    if encoder_heavy:  # the tower alone (its output, hidden_size, is the LLM's width)
        tower = widened(tower, ENCODER_HEAVY_VISION_WIDTH, ("embed_dim", "num_heads"))
    vision = widened(tower, width, ("embed_dim", "hidden_size", "num_heads"))
    # head_dim 16 at every width: the rotary half (8 frequencies) split over (temporal, height, width)
    text = dict(
        vocab_size=len(tokenizer),
        **widened(TEXT_SIZES, width, WIDTH_KEYS),
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        tie_word_embeddings=tie_word_embeddings,
        **special_token_ids(tokenizer),
    )
    config_class, model_class, vision = _qwen2_vl_classes(family, vision)
    config = config_class(
        vision_config=vision,
        text_config=text,
        **vision_token_ids(tokenizer),
        tie_word_embeddings=tie_word_embeddings,
    )
    image_processor = patch_grid_image_processor(min_pixels, max_pixels, patch_size)
    return save_seeded(f"tiny_{family}_", model_class, config, seed, tokenizer, image_processor)


def build_tiny_qwen2_vl(
    dir: str | Path,
    *,
    family: str = "qwen2_vl",
    tie_word_embeddings: bool = False,
    seed: int = 0,
    min_pixels: int = MIN_PIXELS,
    max_pixels: int = MAX_PIXELS,
    patch_size: int = PATCH,
    width: int = 1,
    encoder_heavy: bool = False,
) -> Path:
    """Write a tiny random Qwen2-VL model, its tokenizer and its image processor to ``dir``
    (``save_pretrained`` layout, no processor class: Qwen2-VL's wants torchvision for videos);
    returns ``dir``.

    ``family``: ``"qwen2_vl"`` or ``"qwen2_5_vl"`` (windowed vision attention). Images keep their
    own size within ``min_pixels``..``max_pixels`` (the processor's resize rule, in multiples of
    ``patch x merge`` = 8 px): every image gives its own patch grid. ``patch_size`` 14 gives the
    real models' 28 px unit (ms-swift's Qwen2-VL template resizes images to multiples of 28 itself).
    ``width`` widens the vision tower and the LLM alike (:func:`~dflop_ds.testing.hf_tiny.widened`:
    the same layers and head size), for benchmarks whose compute must outweigh per-module overheads.
    ``encoder_heavy``: the vision tower :data:`ENCODER_HEAVY_VISION_WIDTH` times wider, so that it
    carries most of an image's work, as in real Qwen2-VL models.
    """
    built = _built_qwen2_vl(
        family,
        bool(tie_word_embeddings),
        int(seed),
        int(min_pixels),
        int(max_pixels),
        int(patch_size),
        int(width),
        bool(encoder_heavy),
    )
    return copied(built, dir)


__all__ = ["ENCODER_HEAVY_VISION_WIDTH", "QWEN2_VL_FAMILIES", "build_tiny_qwen2_vl"]
