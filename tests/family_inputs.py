"""What the parametrised family tests (tests/test_family_contract.py, the Trainer's packing test,
the 2-rank Trainer script) run on: a tiny checkpoint builder for every registered HF model family
by the family's name (a family registered without one fails
``test_every_registered_family_has_a_tiny_builder``), HF model inputs with the family's images, and
a user's padded collator."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from dflop_ds.hf_trainer.guard import blank_image_for
from dflop_ds.hf_trainer.packing import MEDIA_KEYS, concatenated_media
from dflop_ds.testing.hf_tiny import build_tiny_llava
from dflop_ds.testing.internvl_tiny import build_tiny_internvl
from dflop_ds.testing.llava_onevision_tiny import build_tiny_llava_onevision
from dflop_ds.testing.qwen2_vl_tiny import build_tiny_qwen2_vl
from dflop_ds.testing.qwen3_vl_tiny import build_tiny_qwen3_vl

#: family name -> ``(dir) -> dir`` writing a tiny random checkpoint of it (model, tokenizer, image processor)
FAMILY_BUILDERS: dict[str, Callable[[Path], Path]] = {
    "LLaVA": partial(build_tiny_llava, vision="clip", text="llama"),
    "Qwen2-VL": build_tiny_qwen2_vl,
    "LLaVA-OneVision": build_tiny_llava_onevision,
    "InternVL": build_tiny_internvl,
    "Qwen3-VL": build_tiny_qwen3_vl,
}


class RightPadCollator:
    """A Trainer user's padded collator: right-pads every per-token key, concatenates the media
    (``keys``, ``padded``: as the model's family joins them)."""

    def __init__(self, keys: tuple[str, ...] = MEDIA_KEYS, padded: tuple[str, ...] = ()) -> None:
        self.keys, self.padded = keys, padded

    def __call__(self, items: list[dict]) -> dict:

        length = max(len(item["input_ids"]) for item in items)
        tokens = [key for key in ("input_ids", "labels", "mm_token_type_ids") if key in items[0]]
        batch = {key: torch.full((len(items), length), -100 if key == "labels" else 0) for key in tokens}
        batch["attention_mask"] = torch.zeros((len(items), length), dtype=torch.long)
        for row, item in enumerate(items):
            n = len(item["input_ids"])
            for key in tokens:
                batch[key][row, :n] = item[key]
            batch["attention_mask"][row, :n] = 1
        return {**batch, **concatenated_media(items, self.keys, self.padded)}


def image_chats(config, count: int, every: int = 2, seed: int = 3, video_every: int = 0) -> list[dict]:
    """``count`` HF model inputs of varied length, one in ``every`` with an image of the model's
    (its image tokens ignored in the labels; Qwen2-VL's also with ``mm_token_type_ids``, the image
    2 x 2 merged patches, so its M-RoPE positions are not the text's; LLaVA-OneVision's with its
    ``image_sizes``); the others say ``pixel_values=None``, as a user's text-only items may.
    ``video_every`` (a family whose tower runs apart for videos: Qwen2-VL's, LLaVA-OneVision's): one
    in that many items also holds a video of the family's blank video's shape (``pixel_values_videos``;
    Qwen2-VL's of the image's size)."""
    blank = blank_image_for(config)
    assert blank is not None
    assert not video_every or blank.video is not None, "this family takes no separate videos"
    generator = torch.Generator().manual_seed(seed)
    qwen = blank.grid_thw is not None
    if qwen:
        merged, patch_dim = blank.pixel_shape
        _, height, width = blank.grid_thw
        shape, grid = (4 * merged, patch_dim), (1, 2 * height, 2 * width)
        blank = dataclasses.replace(blank, pixel_shape=shape, tokens=4, grid_thw=grid)
        if blank.video is not None:
            blank = dataclasses.replace(
                blank, video=dataclasses.replace(blank.video, pixel_shape=shape, tokens=4, grid_thw=grid)
            )
    video_token = None if blank.video is None else blank.video.token_id
    media_tokens = sorted({blank.image_token_id, video_token} - {None})
    items = []
    for i in range(count):
        ids = torch.randint(5, 150, (6 + 3 * i,), generator=generator)
        for token in media_tokens:
            ids[ids == token] = token + 1  # media tokens only where the media are
        image = i % every == 0
        video = blank.video if video_every and i % video_every == 1 else None
        if image:
            ids = torch.cat([ids[:2], torch.full((blank.tokens,), blank.image_token_id), ids[2:]])
        if video is not None:
            ids = torch.cat([ids[:1], torch.full((video.tokens,), video.token_id), ids[1:]])
        labels = torch.where(torch.isin(ids, torch.tensor(media_tokens)), -100, ids)
        item = {"input_ids": ids, "labels": labels}
        if qwen:
            item["mm_token_type_ids"] = (ids == blank.image_token_id).long() + 2 * (ids == video_token).long()
        if image:
            item["pixel_values"] = torch.rand(blank.pixel_shape, generator=generator)
            if qwen:
                item["image_grid_thw"] = torch.tensor([blank.grid_thw])
            if blank.image_sizes is not None:
                item["image_sizes"] = torch.tensor([blank.image_sizes])
        else:
            item["pixel_values"] = None
        if video is not None:
            item["pixel_values_videos"] = torch.rand(video.pixel_shape, generator=generator)
            if video.grid_thw is not None:
                item["video_grid_thw"] = torch.tensor([video.grid_thw])
        items.append(item)
    return items
