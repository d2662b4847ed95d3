"""A tiny random HF LLaVA-OneVision model directory, built offline, for tests and demos: a
``LlavaOnevisionForConditionalGeneration`` (SigLIP tower, Qwen2 text model), the tiny BPE tokenizer
of :mod:`~dflop_ds.testing.hf_tiny` with ``<image>`` and ``<video>``, and a
``LlavaOnevisionImageProcessorPil`` (no processor class: LLaVA-OneVision's wants torchvision for
videos). Tiles are :data:`TILE` px of :data:`PATCH` px patches (16 features each); the grid
pinpoints and ``anyres_max_N`` are arguments, so tests can build other checkpoints."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

from dflop_ds.testing.hf_tiny import (
    SPECIAL_TOKENS,
    TEXT_SIZES,
    VISION_LAYERS,
    build_tokenizer,
    copied,
    saved,
)

TILE = 16
PATCH = 4
#: every grid of 1 to 3 tiles a side
PINPOINTS = tuple((TILE * rows, TILE * cols) for rows in range(1, 4) for cols in range(1, 4))


def build_onevision_tokenizer():
    """The tiny BPE tokenizer with ``<image>`` and ``<video>`` (both named)."""
    return build_tokenizer(SPECIAL_TOKENS + ("<video>",), {"image_token": "<image>", "video_token": "<video>"})


@cache
def _built(pinpoints: tuple, max_tiles: int, tile: int, patch: int, tie_word_embeddings: bool, seed: int) -> Path:
    import torch
    from transformers import (
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
        Qwen2Config,
        SiglipVisionConfig,
    )
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )

    tokenizer = build_onevision_tokenizer()
    ids = dict(
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id
    )
    vision = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=VISION_LAYERS,
        num_attention_heads=2,
        image_size=tile,
        patch_size=patch,
    )
    text_sizes: dict[str, Any] = dict(
        vocab_size=len(tokenizer), **TEXT_SIZES, tie_word_embeddings=tie_word_embeddings, **ids
    )
    text = Qwen2Config(**text_sizes)
    settings: dict[str, Any] = dict(
        vision_config=vision,
        text_config=text,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        video_token_id=tokenizer.convert_tokens_to_ids("<video>"),
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
        vision_aspect_ratio=f"anyres_max_{max_tiles}",
        image_grid_pinpoints=[list(p) for p in pinpoints],
        tie_word_embeddings=tie_word_embeddings,
        **ids,
    )
    config = LlavaOnevisionConfig(**settings)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlavaOnevisionForConditionalGeneration(config)
    image_processor = LlavaOnevisionImageProcessorPil(
        size={"height": tile, "width": tile}, image_grid_pinpoints=[list(p) for p in pinpoints]
    )
    return saved("tiny_llava_onevision_", model, tokenizer, image_processor)


def build_tiny_llava_onevision(
    dir: str | Path,
    *,
    pinpoints: tuple[tuple[int, int], ...] = PINPOINTS,
    max_tiles: int = 2,
    tile: int = TILE,
    patch: int = PATCH,
    tie_word_embeddings: bool = False,
    seed: int = 0,
) -> Path:
    """Write a tiny random LLaVA-OneVision model, tokenizer and image processor to ``dir``
    (``save_pretrained`` layout, no processor class); returns ``dir``. ``pinpoints``: the AnyRes
    canvases ``(height, width)``; ``max_tiles``: ``N`` of ``vision_aspect_ratio="anyres_max_N"``
    (small, so that large grids are pooled)."""
    built = _built(
        tuple(map(tuple, pinpoints)), int(max_tiles), int(tile), int(patch), bool(tie_word_embeddings), int(seed)
    )
    return copied(built, dir)


__all__ = ["PATCH", "PINPOINTS", "TILE", "build_onevision_tokenizer", "build_tiny_llava_onevision"]
