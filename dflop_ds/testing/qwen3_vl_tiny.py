"""A tiny random HF Qwen3-VL model directory, built offline, for tests and demos: the model (two of its
three vision blocks feed deepstack features to the first two decoder layers), the tiny BPE tokenizer
of :mod:`~dflop_ds.testing.hf_tiny` with Qwen3-VL's special tokens, and its image processor (the one
Qwen3-VL's processor uses, with tiny patches; no processor class: its video processor wants torchvision)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from dflop_ds.testing.hf_tiny import SPECIAL_TOKENS, TEXT_SIZES, VISION_LAYERS, build_tokenizer, copied, saved

#: Qwen3-VL's chat and vision tokens (``<|image_pad|>`` is the image token the prompt carries)
QWEN3_VL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
QWEN3_VL_PATCH = 4
QWEN3_VL_MERGE = 2
QWEN3_VL_MIN_PIXELS = (QWEN3_VL_PATCH * QWEN3_VL_MERGE) ** 2  # one LLM token
QWEN3_VL_MAX_PIXELS = 32 * 32  # 64 patches, 16 LLM tokens


@cache
def _built_qwen3_vl(tie_word_embeddings: bool, seed: int, deepstack: tuple[int, ...]) -> Path:
    """Build and save one tiny Qwen3-VL directory in a process-wide temporary folder (cached)."""
    import torch
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = build_tokenizer(
        SPECIAL_TOKENS[:4] + QWEN3_VL_TOKENS, {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"}
    )
    ids = dict(
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id
    )
    token = tokenizer.convert_tokens_to_ids
    vision = dict(
        depth=VISION_LAYERS,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=TEXT_SIZES["hidden_size"],
        patch_size=QWEN3_VL_PATCH,
        spatial_merge_size=QWEN3_VL_MERGE,
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
        **ids,
    )
    config = transformers.Qwen3VLConfig(
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
        model = transformers.Qwen3VLForConditionalGeneration(config)
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=QWEN3_VL_MIN_PIXELS,
        max_pixels=QWEN3_VL_MAX_PIXELS,
        patch_size=QWEN3_VL_PATCH,
        temporal_patch_size=2,
        merge_size=QWEN3_VL_MERGE,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    return saved("tiny_qwen3_vl_", model, tokenizer, image_processor)


def build_tiny_qwen3_vl(
    dir: str | Path, *, tie_word_embeddings: bool = False, seed: int = 0, deepstack: tuple[int, ...] = (0, 1)
) -> Path:
    """Write a tiny random Qwen3-VL model, its tokenizer and its image processor to ``dir``
    (``save_pretrained`` layout); returns ``dir``. ``deepstack``: the vision blocks whose features
    are added to the first decoder layers (``deepstack_visual_indexes``). Images keep their own size
    within 64..1024 pixels (multiples of ``patch x merge`` = 8 px): every image gives its own grid."""
    return copied(_built_qwen3_vl(bool(tie_word_embeddings), int(seed), tuple(int(i) for i in deepstack)), dir)


__all__ = ["QWEN3_VL_TOKENS", "build_tiny_qwen3_vl"]
