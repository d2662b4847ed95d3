"""Qwen3-VL contract microbatches built straight from (prompt, answer, images), for checks and tests.

The directory's tokenizer and image processor do the work of Qwen3-VL's processor class (whose
video processor needs torchvision): every ``<|image_pad|>`` of the prompt (one per image, as Qwen3-VL's
chat template writes it between ``<|vision_start|>`` and ``<|vision_end|>``) is repeated as many
times as the image gives LLM tokens (its patch grid ``t*h*w / merge**2``); the answer and eos are
appended and supervised. The result follows the Qwen3-VL microbatch contract
(``((pixel_values, input_ids, seq_lens, image_grid_thw), (targets, loss_denominator))``,
:mod:`dflop_ds.models.hf.qwen3_vl.model`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from dflop_ds.models.hf.base.folder import load_tokenizer_and_image_processor
from dflop_ds.models.hf.base.layers import padding_mask
from dflop_ds.models.hf.base.synthetic import Sample, append_answer, pad_token_id, stack_rows

#: how a prompt marks an image (Qwen3-VL's chat template)
IMAGE_MARK = "<|vision_start|><|image_pad|><|vision_end|>"


class Qwen3VLInputs:
    """Tokenizer + image processor of a Qwen3-VL model directory, checked against the model config."""

    def __init__(self, tokenizer: Any, image_processor: Any, config: Any, where: str = "model") -> None:
        vision = config.vision_config
        expected = {
            "patch_size": vision.patch_size,
            "merge_size": vision.spatial_merge_size,
            "temporal_patch_size": vision.temporal_patch_size,
        }
        for key, value in expected.items():
            if int(getattr(image_processor, key)) != int(value):
                raise ValueError(
                    f"{where}: the image processor's {key}={getattr(image_processor, key)} but the "
                    f"model's vision config has {value}"
                )
        self.tokenizer, self.image_processor = tokenizer, image_processor
        self.image_token_id = int(config.image_token_id)
        self.merge_size = int(vision.spatial_merge_size)
        self.patch_dim = int(vision.in_channels) * int(vision.temporal_patch_size) * int(vision.patch_size) ** 2

    @classmethod
    def from_dir(cls, model_dir: str | Path, config: Any) -> Qwen3VLInputs:
        """Load the directory's tokenizer and image processor (offline)."""
        return cls(*load_tokenizer_and_image_processor(model_dir), config, str(model_dir))

    def pixel_values(self, images: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(pixel_values [P, C*T*p*p], image_grid_thw [n, 3])`` of PIL ``images`` (none: empty)."""
        if not images:
            return torch.zeros(0, self.patch_dim), torch.zeros(0, 3, dtype=torch.long)
        encoded = self.image_processor(images=list(images), return_tensors="pt")
        return encoded["pixel_values"].float(), encoded["image_grid_thw"].long()

    def encode_sample(self, prompt: str, answer: str, images: Sequence[Any]):
        """``(pixel_values, image_grid_thw, input_ids [L], targets [L])`` of one sample."""
        prompt_ids = torch.tensor(self.tokenizer(prompt, add_special_tokens=False)["input_ids"], dtype=torch.long)
        marks = int((prompt_ids == self.image_token_id).sum())
        if marks != len(images):
            raise ValueError(
                f"prompt {prompt[:60]!r} has {marks} image token(s) but {len(images)} image(s) come with it"
            )
        pixel_values, grid = self.pixel_values(images)
        counts = iter((grid.prod(-1) // self.merge_size**2).tolist())
        pieces = [
            torch.full((next(counts),), token) if token == self.image_token_id else torch.tensor([token])
            for token in prompt_ids.tolist()
        ]
        ids = torch.cat(pieces) if pieces else prompt_ids
        return (pixel_values, grid, *append_answer(self.tokenizer, ids, answer))

    def microbatch(self, samples: Sequence[Sample], *, denominator: float | None = None, packed: bool = False):
        """``((pixel_values, input_ids, seq_lens, image_grid_thw), (targets, loss_denominator))`` of
        ``samples``; ``packed``: the samples in one row instead of right-padded rows."""
        if not samples:
            raise ValueError("Qwen3VLInputs.microbatch: no samples")
        for sample in samples:
            if len(sample) > 3:
                raise ValueError("Qwen3VLInputs.microbatch: videos are not supported for Qwen3-VL yet")
        encoded = [self.encode_sample(*sample) for sample in samples]
        input_ids, seq_lens, targets, count = stack_rows(
            [(row[2], row[3]) for row in encoded], pad_token_id(self.tokenizer), denominator, packed
        )
        pixel_values = torch.cat([row[0] for row in encoded])
        grid = torch.cat([row[1] for row in encoded])
        return (pixel_values, input_ids, seq_lens, grid), (targets, count)


def qwen3_vl_hf_kwargs(inputs: Sequence[torch.Tensor], config: Any) -> dict[str, Any]:
    """The HF Qwen3-VL model's keyword arguments for a contract microbatch: ``mm_token_type_ids``
    marking image tokens 1; no pixels nor grid without images."""
    pixel_values, input_ids, seq_lens, grid = inputs
    kwargs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": padding_mask(seq_lens, input_ids.shape[1])}
    if grid.shape[0]:
        kwargs.update(
            pixel_values=pixel_values,
            image_grid_thw=grid,
            mm_token_type_ids=(input_ids == int(config.image_token_id)).int(),
        )
    return kwargs


__all__ = ["IMAGE_MARK", "Qwen3VLInputs", "qwen3_vl_hf_kwargs"]
