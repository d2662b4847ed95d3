"""What the tiny Qwen2-VL, Qwen2.5-VL and Qwen3-VL builders share: their chat and vision tokens,
the tokenizer naming them, the config's token ids, a seeded model and the patch-grid image
processor (tiny patches: ``patch x merge`` = 8 px is one LLM token)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflop_ds.testing.hf_tiny import SPECIAL_TOKENS, build_tokenizer, saved

#: the chat and vision tokens of the patch-grid families (``<|image_pad|>`` is the image token the prompt carries)
PATCH_GRID_TOKENS = (
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
PATCH = 4
MERGE = 2
MIN_PIXELS = (PATCH * MERGE) ** 2  # one LLM token
MAX_PIXELS = 32 * 32  # 64 patches, 16 LLM tokens


def build_patch_grid_tokenizer():
    """The tiny BPE tokenizer with the patch-grid families' special tokens (``image_token`` and
    ``video_token`` named)."""
    return build_tokenizer(
        SPECIAL_TOKENS[:4] + PATCH_GRID_TOKENS, {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"}
    )


def special_token_ids(tokenizer) -> dict[str, Any]:
    """The text config's pad, bos and eos ids of ``tokenizer``."""
    return dict(
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id
    )


def vision_token_ids(tokenizer) -> dict[str, Any]:
    """The model config's image, video and vision start/end token ids of ``tokenizer``."""
    token = tokenizer.convert_tokens_to_ids
    return dict(
        image_token_id=token("<|image_pad|>"),
        video_token_id=token("<|video_pad|>"),
        vision_start_token_id=token("<|vision_start|>"),
        vision_end_token_id=token("<|vision_end|>"),
    )


def save_seeded(prefix: str, model_class: Any, config: Any, seed: int, tokenizer, image_processor) -> Path:
    """``model_class(config)`` initialised under ``seed`` (the global RNG left as it was), saved with
    ``tokenizer`` and ``image_processor`` in a new process-wide temporary folder."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    return saved(prefix, model, tokenizer, image_processor)


def patch_grid_image_processor(
    min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS, patch_size: int = PATCH, **options: Any
):
    """The PIL Qwen2-VL image processor (the one Qwen2-VL, Qwen2.5-VL and Qwen3-VL use) with tiny
    patches; ``options`` as its own (e.g. ``image_mean``)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        patch_size=patch_size,
        temporal_patch_size=2,
        merge_size=MERGE,
        **options,
    )
