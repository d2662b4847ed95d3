"""A tiny random HF InternVL model directory, built offline, for tests and demos: an
``InternVLForConditionalGeneration`` (InternViT tower, Qwen2 text model), the tiny BPE tokenizer of
:mod:`~dflop_ds.testing.hf_tiny` with InternVL's ``<img>``, ``</img>``, ``<IMG_CONTEXT>`` and
``<video>`` tokens, and a ``GotOcr2ImageProcessorPil`` cutting images into 1..``max_tiles`` tiles
plus a thumbnail (no processor class: InternVL's wants torchvision for videos). Tiles are
:data:`TILE` px of :data:`PATCH` px patches, pixel-shuffled to 4 tokens each."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

from dflop_ds.testing.hf_tiny import SPECIAL_TOKENS, TEXT_SIZES, VISION_LAYERS, build_tokenizer, copied, saved

TILE = 16
PATCH = 4
#: InternVL's named tokens
INTERNVL_TOKENS = {
    "start_image_token": "<img>",
    "end_image_token": "</img>",
    "context_image_token": "<IMG_CONTEXT>",
    "video_token": "<video>",
}


def build_internvl_tokenizer():
    """The tiny BPE tokenizer with InternVL's image tokens (named as its processor reads them)."""
    return build_tokenizer(SPECIAL_TOKENS[:4] + tuple(INTERNVL_TOKENS.values()), dict(INTERNVL_TOKENS))


@cache
def _built(min_tiles: int, max_tiles: int, feature_layer: int, tie_word_embeddings: bool, seed: int) -> Path:
    import torch
    from transformers import InternVLConfig, InternVLForConditionalGeneration, InternVLVisionConfig, Qwen2Config
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    tokenizer = build_internvl_tokenizer()
    ids = dict(
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id
    )
    vision = InternVLVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=VISION_LAYERS,
        num_attention_heads=2,
        image_size=[TILE, TILE],
        patch_size=[PATCH, PATCH],
    )
    text_sizes: dict[str, Any] = dict(
        vocab_size=len(tokenizer), **TEXT_SIZES, tie_word_embeddings=tie_word_embeddings, **ids
    )
    settings: dict[str, Any] = dict(
        vision_config=vision,
        text_config=Qwen2Config(**text_sizes),
        image_token_id=tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>"),
        image_seq_length=(TILE // PATCH) ** 2 // 4,
        vision_feature_layer=feature_layer,
        tie_word_embeddings=tie_word_embeddings,
        **ids,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = InternVLForConditionalGeneration(InternVLConfig(**settings))
    image_processor = GotOcr2ImageProcessorPil(
        size={"height": TILE, "width": TILE}, crop_to_patches=True, min_patches=min_tiles, max_patches=max_tiles
    )
    return saved("tiny_internvl_", model, tokenizer, image_processor)


def build_tiny_internvl(
    dir: str | Path,
    *,
    min_tiles: int = 1,
    max_tiles: int = 6,
    feature_layer: int = -1,
    tie_word_embeddings: bool = False,
    seed: int = 0,
) -> Path:
    """Write a tiny random InternVL model, tokenizer and image processor to ``dir`` (``save_pretrained``
    layout, no processor class); returns ``dir``. ``min_tiles``/``max_tiles``: the dynamic tiling's
    limits; ``feature_layer``: ``vision_feature_layer``."""
    return copied(_built(int(min_tiles), int(max_tiles), int(feature_layer), bool(tie_word_embeddings), int(seed)), dir)


__all__ = ["INTERNVL_TOKENS", "PATCH", "TILE", "build_internvl_tokenizer", "build_tiny_internvl"]
