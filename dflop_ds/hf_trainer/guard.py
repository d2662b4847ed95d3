"""A blank image for a microbatch that has none, so ZeRO's gradient reduction stays in step.

Under ZeRO-2/3 every data-parallel rank reduces its gradients in buckets filled in the order the
backward pass produces them. A microbatch without images skips the vision tower, so on that rank
the tower's parameters get no gradient and the ranks' reductions no longer match (a size mismatch
or, worse, gradients summed out of place). The project's own layers send a blank placeholder image
through the tower (``dflop_ds.models.hf.base.vision.VisionEmbeddings``, ``dflop_ds.models.hf.qwen2_vl.
model.PatchEmbedding``); for a user's HF model and collator, :func:`with_blank_image` does the same on
the batch: one blank image is appended after the last token of row 0 with its image tokens, masked
out of attention and of the loss. Causal attention keeps every real token from seeing it, so the
loss and every gradient are unchanged (the tower's gradient from it is exactly zero), while the
backward pass runs the same operations in the same order as on a rank with images.

The blank image is the model family's (:class:`~dflop_ds.models.hf.trainer_parts.BlankImage`,
looked up once through the registry): its pixel shape, its token count and the extra tensors the
model takes with it (Qwen2-VL's ``image_grid_thw`` and ``mm_token_type_ids``, LLaVA-OneVision's
``image_sizes``). A padding-free batch's ``position_ids`` (``[B, L]`` or ``[3 or 4, B, L]``) are
extended with zeros: the blank tokens start sequences of their own. Qwen2-VL runs one tower for
images and videos, so a microbatch with a video needs nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from dflop_ds.models.hf.registry import trainer_parts_of
from dflop_ds.models.hf.trainer_parts import BlankImage
from dflop_ds.models.tiny_data import IGNORE_INDEX

logger = logging.getLogger(__name__)

#: batch keys that are per-token targets (filled with the ignore index where the blank image goes)
TARGET_KEYS = ("labels", "shift_labels")
#: batch keys that carry visual input: a batch with any of them non-empty runs the vision tower
VISUAL_KEYS = ("pixel_values", "pixel_values_videos")
#: Qwen2-VL's per-token modality key and its value for image tokens (text is 0, video 2)
TOKEN_TYPE_KEY, IMAGE_TOKEN_TYPE = "mm_token_type_ids", 1


def blank_image_for(config: Any) -> BlankImage | None:
    """The blank image of a model's config, from its family in the registry; None for a model no
    family registers, or a config its family gives none for (the guard then does nothing)."""
    parts = trainer_parts_of(config)
    return None if parts is None else parts.blank_image(config)


def has_images(inputs: Mapping[str, Any]) -> bool:
    """Whether a batch carries visual input: ``pixel_values`` (or Qwen2-VL's
    ``pixel_values_videos``) present and not empty."""
    return any(inputs.get(key) is not None and inputs[key].numel() > 0 for key in VISUAL_KEYS)


def with_blank_image(inputs: Mapping[str, Any], blank: BlankImage) -> dict[str, Any]:
    """``inputs`` (a batch with ``input_ids [B, L]`` and no images) with one blank image
    appended after position ``L - 1``: row 0 gets its image tokens, other rows padding; the new
    positions are 0 in ``attention_mask`` and ``position_ids``, ignored in ``labels``, a sample of
    their own in a padding-free batch's ``cu_seq_lens_q/k``; every other ``[B, L]`` tensor is
    extended with zeros. The loss and the gradients are those of ``inputs``."""
    ids = inputs["input_ids"]
    rows, length = ids.shape
    extra = blank.tokens
    out: dict[str, Any] = dict(inputs)
    tail = torch.full((rows, extra), blank.pad_token_id, dtype=ids.dtype, device=ids.device)
    tail[0] = blank.image_token_id
    out["input_ids"] = torch.cat([ids, tail], dim=1)
    for key, value in inputs.items():
        if key == "input_ids" or not torch.is_tensor(value):
            continue
        if key == "position_ids" and value.dim() == 3 and tuple(value.shape[1:]) == (rows, length):
            out[key] = torch.cat([value, value.new_zeros((*value.shape[:2], extra))], dim=2)
        elif tuple(value.shape[:2]) == (rows, length):
            fill = IGNORE_INDEX if key in TARGET_KEYS else 0
            pad = torch.full((rows, extra, *value.shape[2:]), fill, dtype=value.dtype, device=value.device)
            out[key] = torch.cat([value, pad], dim=1)
    if "cu_seq_lens_q" in inputs:  # a padding-free batch's sample bounds: the blank image is one more sample
        for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
            bounds = inputs[key]
            out[key] = torch.cat([bounds, bounds[-1:] + extra])
        for key in ("max_length_q", "max_length_k"):
            out[key] = max(int(inputs[key]), extra)
    out["pixel_values"] = torch.zeros(blank.pixel_shape, device=ids.device)
    if blank.image_sizes is not None:
        out["image_sizes"] = torch.tensor([blank.image_sizes], dtype=torch.long, device=ids.device)
    if "batch_num_images" in inputs:  # images per row: the blank one is row 0's
        out["batch_num_images"] = torch.tensor([1] + [0] * (rows - 1), dtype=torch.long, device=ids.device)
    if blank.grid_thw is not None:
        out["image_grid_thw"] = torch.tensor([blank.grid_thw], dtype=torch.long, device=ids.device)
        types = out.get(TOKEN_TYPE_KEY)
        if types is None:
            types = torch.zeros_like(out["input_ids"], dtype=torch.int)
        types = types.clone()
        types[0, length:] = IMAGE_TOKEN_TYPE
        out[TOKEN_TYPE_KEY] = types
    return out


def guarded_batch(model: Any, inputs: Any, blank: BlankImage | None) -> Any:
    """``inputs`` with :func:`with_blank_image` when ``model`` trains on a microbatch without visual
    input and ``blank`` is its blank image; else ``inputs`` unchanged."""
    if blank is not None and model.training and "input_ids" in inputs and not has_images(inputs):
        return with_blank_image(inputs, blank)
    return inputs


class BlankImageGuardMixin:
    """Put before ``transformers.Trainer`` in the bases: a training microbatch without images (or
    videos) of a model whose family gives a blank image gets one (:func:`with_blank_image`) before
    the Trainer's loss.
    :class:`~dflop_ds.hf_trainer.DFLOPTrainerMixin` includes it; alone it keeps any other sampler
    (the Trainer's own) from breaking ZeRO's reduction on image-free microbatches."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        config = getattr(getattr(self, "model", None), "config", None)
        self._blank_image = blank_image_for(config)
        if self._blank_image is None and getattr(config, "vision_config", None) is not None:
            logger.warning(
                "no blank-image guard for model type %r (no registered family gives one for this config): under"
                " ZeRO-2/3 a microbatch without images on one rank beside images on another can abort the gradient"
                " reduction",
                getattr(config, "model_type", None),
            )

    def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's loss, after the blank image where a training microbatch has no visual input."""
        return super().compute_loss(model, guarded_batch(model, inputs, self._blank_image), *args, **kwargs)  # type: ignore[misc]


__all__ = ["BlankImage", "BlankImageGuardMixin", "blank_image_for", "guarded_batch", "has_images", "with_blank_image"]
