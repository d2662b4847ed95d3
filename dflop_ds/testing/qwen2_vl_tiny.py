"""A tiny random HF Qwen2-VL (or Qwen2.5-VL) model directory, built offline, for tests and demos:
the model, the tiny BPE tokenizer of :mod:`~dflop_ds.testing.hf_tiny` with Qwen2-VL's special tokens,
and its image processor (no processor class: Qwen2-VL's wants torchvision for videos)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from dflop_ds.testing.hf_tiny import SPECIAL_TOKENS, TEXT_SIZES, VISION_LAYERS, build_tokenizer, copied, saved

#: Qwen2-VL's chat and vision tokens (``<|image_pad|>`` is the image token the prompt carries)
QWEN2_VL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
QWEN2_VL_PATCH = 4
QWEN2_VL_MERGE = 2
QWEN2_VL_MIN_PIXELS = (QWEN2_VL_PATCH * QWEN2_VL_MERGE) ** 2  # one LLM token
QWEN2_VL_MAX_PIXELS = 32 * 32  # 64 patches, 16 LLM tokens


def build_qwen2_vl_tokenizer():
    """The tiny BPE tokenizer with Qwen2-VL's special tokens (``image_token``/``video_token`` named)."""
    return build_tokenizer(
        SPECIAL_TOKENS[:4] + QWEN2_VL_TOKENS, {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"}
    )


QWEN2_VL_FAMILIES = ("qwen2_vl", "qwen2_5_vl")


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
    family: str, tie_word_embeddings: bool, seed: int, min_pixels: int, max_pixels: int, patch_size: int
) -> Path:
    """Build and save one tiny Qwen2-VL directory in a process-wide temporary folder (cached)."""
    import torch
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = build_qwen2_vl_tokenizer()
    ids = dict(
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id
    )
    token = tokenizer.convert_tokens_to_ids
    vision = dict(
        depth=VISION_LAYERS,
        embed_dim=32,
        hidden_size=64,
        mlp_ratio=2,
        num_heads=2,
        patch_size=patch_size,
        spatial_merge_size=QWEN2_VL_MERGE,
        temporal_patch_size=2,
    )
    # head_dim 16: the rotary half (8 frequencies) split over (temporal, height, width)
    text = dict(
        vocab_size=len(tokenizer),
        **TEXT_SIZES,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        tie_word_embeddings=tie_word_embeddings,
        **ids,
    )
    config_class, model_class, vision = _qwen2_vl_classes(family, vision)
    config = config_class(
        vision_config=vision,
        text_config=text,
        image_token_id=token("<|image_pad|>"),
        video_token_id=token("<|video_pad|>"),
        vision_start_token_id=token("<|vision_start|>"),
        vision_end_token_id=token("<|vision_end|>"),
        tie_word_embeddings=tie_word_embeddings,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        patch_size=patch_size,
        temporal_patch_size=2,
        merge_size=QWEN2_VL_MERGE,
    )
    return saved(f"tiny_{family}_", model, tokenizer, image_processor)


def build_tiny_qwen2_vl(
    dir: str | Path,
    *,
    family: str = "qwen2_vl",
    tie_word_embeddings: bool = False,
    seed: int = 0,
    min_pixels: int = QWEN2_VL_MIN_PIXELS,
    max_pixels: int = QWEN2_VL_MAX_PIXELS,
    patch_size: int = QWEN2_VL_PATCH,
) -> Path:
    """Write a tiny random Qwen2-VL model, its tokenizer and its image processor to ``dir``
    (``save_pretrained`` layout, no processor class: Qwen2-VL's wants torchvision for videos);
    returns ``dir``.

    ``family``: ``"qwen2_vl"`` or ``"qwen2_5_vl"`` (windowed vision attention). Images keep their
    own size within ``min_pixels``..``max_pixels`` (the processor's resize rule, in multiples of
    ``patch x merge`` = 8 px): every image gives its own patch grid. ``patch_size`` 14 gives the
    real models' 28 px unit (ms-swift's Qwen2-VL template resizes images to multiples of 28 itself).
    """
    built = _built_qwen2_vl(
        family, bool(tie_word_embeddings), int(seed), int(min_pixels), int(max_pixels), int(patch_size)
    )
    return copied(built, dir)


__all__ = [
    "QWEN2_VL_FAMILIES",
    "QWEN2_VL_TOKENS",
    "build_qwen2_vl_tokenizer",
    "build_tiny_qwen2_vl",
]
