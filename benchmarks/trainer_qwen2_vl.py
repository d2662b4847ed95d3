"""The Qwen2-VL side of `make bench-trainer`: a Trainer user's Dataset over LLaVA JSON and its padded collator.

* :class:`Qwen2VLJsonDataset`: each record as the HF model takes it (``input_ids``, ``labels``,
  ``mm_token_type_ids``, the images' ``pixel_values``/``image_grid_thw`` and the video's
  ``pixel_values_videos``/``video_grid_thw``), tokenized by the project's Qwen2-VL preprocessor
  (the tiny model has no processor class: Qwen2-VL's wants torchvision for videos), so its tokens
  are the ones ``llava_json_shapes`` counts.
* :class:`Qwen2VLPadCollator`: right-padding, as a Trainer script pads.
The padding-free collator (transformers' ``DataCollatorWithFlattening`` with M-RoPE positions for
Qwen2-VL) is the project's: :class:`dflop_ds.hf_trainer.PaddingFreeCollator`.
"""

from __future__ import annotations

import torch

from dflop_ds.hf_trainer.packing import concatenated_media
from dflop_ds.models.hf.base.dataset import load_llava_records
from dflop_ds.models.hf.qwen2_vl.data import Qwen2VLDataset, Qwen2VLPreprocessor
from dflop_ds.models.tiny_data import IGNORE_INDEX


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
