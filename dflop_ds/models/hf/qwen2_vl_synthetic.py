"""Qwen2-VL contract microbatches built straight from (prompt, answer, images), for checks and tests.

The directory's tokenizer and image processor do the work of the Qwen2-VL processor class
(which needs torchvision): every ``<|image_pad|>`` of the prompt (one per image, as Qwen2-VL's
chat template writes it between ``<|vision_start|>`` and ``<|vision_end|>``) is repeated as many
times as the image gives LLM tokens (its patch grid ``t*h*w / merge**2``); the answer and eos
are appended and supervised. The result follows the Qwen2-VL microbatch contract
(``((pixel_values, input_ids, seq_lens, image_grid_thw), (targets, loss_denominator))``,
``dflop_ds.models.hf.qwen2_vl``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from dflop_ds.models.hf.common import padding_mask
from dflop_ds.models.hf.synthetic import Sample, append_answer, hf_labels, pad_token_id, stack_rows

#: how a prompt marks an image (Qwen2-VL's chat template)
IMAGE_MARK = "<|vision_start|><|image_pad|><|vision_end|>"


class Qwen2VLInputs:
    """Tokenizer + image processor of a Qwen2-VL model directory, checked against the model config."""

    def __init__(self, tokenizer: Any, image_processor: Any, config: Any, where: str = "model") -> None:
        vision = config.vision_config
        expected = {"patch_size": vision.patch_size, "merge_size": vision.spatial_merge_size,
                    "temporal_patch_size": vision.temporal_patch_size}
        for key, value in expected.items():
            if int(getattr(image_processor, key)) != int(value):
                raise ValueError(f"{where}: the image processor's {key}={getattr(image_processor, key)} but the "
                                 f"model's vision config has {value}")
        self.tokenizer, self.image_processor = tokenizer, image_processor
        self.image_token_id = int(config.image_token_id)
        self.merge_size = int(vision.spatial_merge_size)
        self.patch_dim = int(vision.in_channels) * int(vision.temporal_patch_size) * int(vision.patch_size) ** 2

    @classmethod
    def from_dir(cls, model_dir: str | Path, config: Any) -> "Qwen2VLInputs":
        """Load the directory's tokenizer and image processor (offline)."""
        from transformers import AutoImageProcessor, AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
            image_processor = AutoImageProcessor.from_pretrained(model_dir, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{model_dir}: no tokenizer + image processor ({exc})") from exc
        return cls(tokenizer, image_processor, config, str(model_dir))

    def encode_sample(self, prompt: str, answer: str, images: Sequence[Any]):
        """``(pixel_values [P, C*T*p*p], image_grid_thw [n, 3], input_ids [L], targets [L])`` of one sample."""
        prompt_ids = torch.tensor(self.tokenizer(prompt, add_special_tokens=False)["input_ids"], dtype=torch.long)
        marks = int((prompt_ids == self.image_token_id).sum())
        if marks != len(images):
            raise ValueError(f"prompt {prompt[:60]!r} has {marks} image token(s) but {len(images)} image(s) "
                             "come with it")
        if images:
            encoded = self.image_processor(images=list(images), return_tensors="pt")
            pixel_values, grid = encoded["pixel_values"], encoded["image_grid_thw"].long()
        else:
            pixel_values, grid = torch.zeros(0, self.patch_dim), torch.zeros(0, 3, dtype=torch.long)
        counts = iter((grid.prod(-1) // self.merge_size ** 2).tolist())
        pieces = [torch.full((next(counts),), token) if token == self.image_token_id else torch.tensor([token])
                  for token in prompt_ids.tolist()]
        ids = torch.cat(pieces) if pieces else prompt_ids
        return (pixel_values, grid, *append_answer(self.tokenizer, ids, answer))

    def microbatch(self, samples: Sequence[Sample], *, denominator: float | None = None):
        """``((pixel_values, input_ids, seq_lens, image_grid_thw), (targets, loss_denominator))`` of ``samples``."""
        if not samples:
            raise ValueError("Qwen2VLInputs.microbatch: no samples")
        encoded = [self.encode_sample(*sample) for sample in samples]
        input_ids, seq_lens, targets, count = stack_rows([(ids, tgt) for _, _, ids, tgt in encoded],
                                                         pad_token_id(self.tokenizer), denominator)
        pixel_values = torch.cat([px for px, _, _, _ in encoded])
        grid = torch.cat([g for _, g, _, _ in encoded])
        return (pixel_values, input_ids, seq_lens, grid), (targets, count)


def qwen2_vl_hf_kwargs(inputs: Sequence[torch.Tensor], image_token_id: int) -> dict[str, Any]:
    """The HF Qwen2-VL model's keyword arguments for a contract microbatch (``mm_token_type_ids``
    marks image tokens 1; no pixels nor grids without images)."""
    pixel_values, input_ids, seq_lens, grid = inputs
    kwargs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": padding_mask(seq_lens, input_ids.shape[1])}
    if grid.shape[0]:
        kwargs.update(pixel_values=pixel_values, image_grid_thw=grid,
                      mm_token_type_ids=(input_ids == image_token_id).int())
    return kwargs


def qwen2_vl_hf_forward(model: Any, inputs: Sequence[torch.Tensor], targets: torch.Tensor):
    """The HF model's own forward of a Qwen2-VL contract microbatch with labels (its loss: the token mean)."""
    return model(**qwen2_vl_hf_kwargs(inputs, model.config.image_token_id), labels=hf_labels(targets))


__all__ = ["IMAGE_MARK", "Qwen2VLInputs", "qwen2_vl_hf_forward", "qwen2_vl_hf_kwargs"]
