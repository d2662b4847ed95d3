"""Contract microbatches built straight from (prompt, answer, images), for checks and tests.

No chat template and no dataset: the prompt goes through the model directory's processor (which
expands every ``<image>`` into ``image_seq_length`` image tokens), the answer and the eos token
are appended and supervised. The result follows the HF microbatch contract
(``((pixel_values, input_ids, seq_lens), (targets, loss_denominator))``), and
:func:`hf_labels` turns the shifted targets back into the unshifted ``labels`` HF models take.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dflop_ds.models.hf.base.layers import padding_mask
from dflop_ds.models.packing import join_rows
from dflop_ds.pipe.loss import IGNORE_INDEX

Sample = tuple[str, str, Sequence[Any]]  # (prompt with <image> placeholders, answer, PIL images)


def encode_sample(
    processor: Any, prompt: str, answer: str, images: Sequence[Any]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(pixel_values [n, C, H, W], input_ids [L], targets [L])`` of one sample (targets already shifted)."""
    tokenizer = processor.tokenizer
    if images:
        encoded = processor(images=list(images), text=[prompt], return_tensors="pt")
        pixel_values, prompt_ids = encoded["pixel_values"], encoded["input_ids"][0]
    else:
        prompt_ids = torch.tensor(tokenizer(prompt, add_special_tokens=False)["input_ids"], dtype=torch.long)
        pixel_values = None
    return (pixel_values, *append_answer(tokenizer, prompt_ids, answer))


def append_answer(tokenizer: Any, prompt_ids: torch.Tensor, answer: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids [L], targets [L])``: the prompt, then the supervised answer and eos (targets shifted)."""
    answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = torch.cat([prompt_ids.long(), torch.tensor(answer_ids, dtype=torch.long)])
    targets = torch.full_like(ids, IGNORE_INDEX)
    start = prompt_ids.numel()
    targets[start - 1 : -1] = ids[start:]  # the token before each answer token predicts it
    return ids, targets


def stack_rows(
    rows: Sequence[tuple[torch.Tensor, torch.Tensor]],
    pad_id: int,
    denominator: float | None = None,
    packed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids [B, S], seq_lens [B], targets [B, S], loss_denominator)`` of right-padded
    ``(input_ids, targets)`` rows (one packed row ``[1, sum(seq_lens)]`` each with ``packed``);
    ``denominator`` defaults to the rows' target count."""
    seq_lens = torch.tensor([ids.numel() for ids, _ in rows], dtype=torch.long)
    input_ids = join_rows([ids.long() for ids, _ in rows], pad_id, packed)
    targets = join_rows([tgt.long() for _, tgt in rows], IGNORE_INDEX, packed)
    count = float((targets != IGNORE_INDEX).sum()) if denominator is None else float(denominator)
    return input_ids, seq_lens, targets, torch.tensor(count, dtype=torch.float64)


def pad_token_id(tokenizer: Any) -> int:
    """The tokenizer's pad id, eos when it has none."""
    return int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)


def contract_microbatch(
    processor: Any,
    samples: Sequence[Sample],
    *,
    image_shape: Sequence[int] | None = None,
    denominator: float | None = None,
    packed: bool = False,
):
    """One microbatch ``((pixel_values, input_ids, seq_lens), (targets, loss_denominator))``.

    ``image_shape`` ``(C, H, W)`` shapes the empty ``pixel_values`` of a text-only microbatch
    (default: the processor's crop size, 3 channels). ``denominator`` defaults to the
    microbatch's own target count (a per-microbatch token mean). ``packed``: the samples in one
    row (:mod:`dflop_ds.models.packing`) instead of right-padded rows.
    """
    if not samples:
        raise ValueError("contract_microbatch: no samples")
    encoded = [encode_sample(processor, *sample) for sample in samples]
    input_ids, seq_lens, targets, count = stack_rows(
        [(ids, tgt) for _, ids, tgt in encoded], pad_token_id(processor.tokenizer), denominator, packed
    )
    pixels = [px for px, _, _ in encoded if px is not None]
    if pixels:
        pixel_values = torch.cat(pixels)
    else:
        pixel_values = torch.zeros(0, *(image_shape or default_image_shape(processor)))
    return (pixel_values, input_ids, seq_lens), (targets, count)


def default_image_shape(processor: Any) -> tuple[int, int, int]:
    """``(3, H, W)`` of the processor's output images (its crop size, else its size)."""
    image_processor = processor.image_processor
    size = getattr(image_processor, "crop_size", None) or image_processor.size
    size = dict(size)
    if "height" in size:
        return 3, int(size["height"]), int(size["width"])
    edge = int(size["shortest_edge"])
    return 3, edge, edge


def hf_labels(targets: torch.Tensor) -> torch.Tensor:
    """Unshifted HF ``labels`` (``labels[b, t + 1] = targets[b, t]``) from contract targets."""
    if (targets[:, -1] != IGNORE_INDEX).any():
        raise ValueError("targets of the last position must be -100 (nothing follows it)")
    labels = torch.full_like(targets, IGNORE_INDEX)
    labels[:, 1:] = targets[:, :-1]
    return labels


def hf_model_kwargs(inputs: Sequence[torch.Tensor]) -> dict[str, Any]:
    """The HF LLaVA model's keyword arguments for a contract microbatch (no pixels without images)."""
    pixel_values, input_ids, seq_lens = inputs
    mask = padding_mask(seq_lens, input_ids.shape[1])
    pixels = pixel_values if pixel_values.shape[0] else None
    return {"input_ids": input_ids, "pixel_values": pixels, "attention_mask": mask}


def hf_forward(model: Any, inputs: Sequence[torch.Tensor], targets: torch.Tensor):
    """The HF model's own forward of a contract microbatch with labels (its loss: the token mean)."""
    return model(**hf_model_kwargs(inputs), labels=hf_labels(targets))


__all__ = [
    "Sample",
    "append_answer",
    "contract_microbatch",
    "default_image_shape",
    "encode_sample",
    "hf_forward",
    "hf_labels",
    "hf_model_kwargs",
    "pad_token_id",
    "stack_rows",
]
