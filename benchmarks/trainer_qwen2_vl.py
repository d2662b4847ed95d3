"""The Qwen2-VL side of `make bench-trainer`: a Trainer user's Dataset over LLaVA JSON and two collators.

* :class:`Qwen2VLJsonDataset`: each record as the HF model takes it (``input_ids``, ``labels``,
  ``mm_token_type_ids``, the images' ``pixel_values``/``image_grid_thw`` and the video's
  ``pixel_values_videos``/``video_grid_thw``), tokenized by the project's Qwen2-VL preprocessor
  (the tiny model has no processor class: Qwen2-VL's wants torchvision for videos), so its tokens
  are the ones ``llava_json_shapes`` counts.
* :class:`Qwen2VLPadCollator`: right-padding, as a Trainer script pads.
* :class:`FlatCollator`: padding-free, the way transformers 5.24 offers it (for LLaVA too):
  ``DataCollatorWithFlattening`` concatenates the microbatch into one row (``labels`` separated,
  per-sample text ``position_ids``); for Qwen2-VL the model's own ``get_rope_index`` gives each
  sample's three M-RoPE rows, prepended with the text row into ``position_ids [4, 1, N]`` (what
  ``Qwen2VLTextModel.forward`` asks of packed input: it then masks attention per sample, with
  the cache off).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import DataCollatorWithFlattening

from dflop_ds.models.hf.llava_data import load_llava_records
from dflop_ds.models.hf.qwen2_vl_data import Qwen2VLDataset, Qwen2VLPreprocessor
from dflop_ds.models.tiny_data import IGNORE_INDEX

#: per-sample tensors concatenated along dim 0 by both collators (present when any sample has them)
MEDIA_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")


class Qwen2VLJsonDataset(torch.utils.data.Dataset):
    """LLaVA JSON records (images and videos) as Qwen2-VL HF model inputs, index ``i`` = record ``i``
    of ``shapes`` (``llava_json_shapes`` of the same file and model)."""

    def __init__(self, shapes: list, data_path: str, model_dir: str, image_folder: str, video_folder: str) -> None:
        preprocessor = Qwen2VLPreprocessor.from_pretrained(model_dir)
        self.image_token, self.video_token = preprocessor.image_token_id, preprocessor.video_token_id
        self.items = Qwen2VLDataset(
            shapes,
            load_llava_records(data_path),
            preprocessor,
            image_folder,
            source=data_path,
            video_folder=video_folder,
        )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        item = self.items[index]
        ids = item.input_ids
        # the project's targets are shifted (target i predicts token i + 1); the HF model shifts itself
        labels = torch.cat([torch.tensor([IGNORE_INDEX]), item.targets[:-1]])
        types = (ids == self.image_token).int() + 2 * (ids == self.video_token).int()
        out = {"input_ids": ids, "labels": labels, "mm_token_type_ids": types}
        if item.image_grid_thw.shape[0]:
            out["pixel_values"], out["image_grid_thw"] = item.pixel_values, item.image_grid_thw
        if item.video_grid_thw.shape[0]:
            out["pixel_values_videos"], out["video_grid_thw"] = item.pixel_values_videos, item.video_grid_thw
        return out


def concatenated_media(items: list[dict]) -> dict:
    """Every sample's images and video, concatenated in sample order (keys without any left out)."""
    out = {}
    for key in MEDIA_KEYS:
        parts = [item[key] for item in items if key in item]
        if parts:
            out[key] = torch.cat(parts)
    return out


class Qwen2VLPadCollator:
    """Right-pads a microbatch (``attention_mask`` 0 and ``labels`` ignored on padding)."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, items: list[dict]) -> dict:
        rows, length = len(items), max(len(item["input_ids"]) for item in items)
        batch = {
            "input_ids": torch.full((rows, length), self.pad_id),
            "labels": torch.full((rows, length), IGNORE_INDEX),
            "attention_mask": torch.zeros((rows, length), dtype=torch.long),
            "mm_token_type_ids": torch.zeros((rows, length), dtype=torch.int),
        }
        for row, item in enumerate(items):
            n = len(item["input_ids"])
            for key in ("input_ids", "labels", "mm_token_type_ids"):
                batch[key][row, :n] = item[key]
            batch["attention_mask"][row, :n] = 1
        return {**batch, **concatenated_media(items)}


class FlatCollator:
    """Padding-free: transformers' ``DataCollatorWithFlattening`` (one row, ``labels`` separated,
    per-sample text ``position_ids``), the samples' media concatenated; with ``rope_index`` (a
    Qwen2-VL model's ``get_rope_index``) each sample's M-RoPE rows are prepended with the text
    row into ``position_ids [4, 1, N]``; ``sample_bounds``: also the flattening's
    ``cu_seq_lens_q/k`` and ``max_length_q/k`` (what a variable-length attention function reads)."""

    def __init__(self, rope_index: Callable[..., Any] | None = None, sample_bounds: bool = False) -> None:
        self.rope_index = rope_index
        self.flatten = DataCollatorWithFlattening(return_flash_attn_kwargs=sample_bounds)

    def __call__(self, items: list[dict]) -> dict:
        flat = self.flatten([{"input_ids": i["input_ids"].tolist(), "labels": i["labels"].tolist()} for i in items])
        batch = {**flat, **concatenated_media(items)}
        if self.rope_index is None:
            return batch
        rows = []
        for item in items:
            positions, _ = self.rope_index(
                item["input_ids"][None],
                item["mm_token_type_ids"][None],
                image_grid_thw=item.get("image_grid_thw"),
                video_grid_thw=item.get("video_grid_thw"),
            )
            rows.append(positions)
        batch["position_ids"] = torch.cat([flat["position_ids"][None], torch.cat(rows, dim=2)], dim=0)
        batch["mm_token_type_ids"] = torch.cat([item["mm_token_type_ids"] for item in items])[None]
        return batch
