"""A blank image for a LLaVA microbatch that has none, so ZeRO's gradient reduction stays in step.

Under ZeRO-2/3 every data-parallel rank reduces its gradients in buckets filled in the order the
backward pass produces them. A microbatch without images skips the vision tower, so on that rank
the tower's parameters get no gradient and the ranks' reductions no longer match (a size mismatch
or, worse, gradients summed out of place). The project's own layers send a blank placeholder image
through the tower (``dflop_ds.models.hf.llava.VisionEmbeddings``); for a user's HF model and
collator, :func:`with_blank_image` does the same on the batch: one blank image is appended after
the last token of row 0 with its image tokens, masked out of attention and of the loss. Causal
attention keeps every real token from seeing it, so the loss and every gradient are unchanged
(the tower's gradient from it is exactly zero), while the backward pass runs the same operations
in the same order as on a rank with images.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from dflop_ds.models.hf.llava import MODEL_TYPE as LLAVA_TYPE
from dflop_ds.models.tiny_data import IGNORE_INDEX

logger = logging.getLogger(__name__)

#: batch keys that are per-token targets (filled with the ignore index where the blank image goes)
TARGET_KEYS = ("labels", "shift_labels")


@dataclass(frozen=True)
class BlankImage:
    """What a LLaVA model needs to take one blank image: its pixel tensor shape, the image token
    and how many of them one image becomes, and a token id for the other rows' padding."""

    pixel_shape: tuple[int, int, int]
    image_token_id: int
    tokens: int
    pad_token_id: int

    @classmethod
    def for_model(cls, config: Any) -> BlankImage | None:
        """The blank image of a ``LlavaForConditionalGeneration`` config; None for another model
        (the guard then does nothing)."""
        if getattr(config, "model_type", None) != LLAVA_TYPE or not isinstance(config.vision_feature_layer, int):
            return None
        vision = config.vision_config
        patches = (int(vision.image_size) // int(vision.patch_size)) ** 2
        has_cls = str(vision.model_type).startswith("clip")
        tokens = patches + int(has_cls) - int(has_cls and config.vision_feature_select_strategy == "default")
        text = config.text_config
        pad = getattr(text, "pad_token_id", None)
        image_token_id = int(config.image_token_id)
        if pad is None or int(pad) == image_token_id:
            pad = 0 if image_token_id != 0 else 1
        return cls(
            (int(vision.num_channels), int(vision.image_size), int(vision.image_size)), image_token_id, tokens, int(pad)
        )


def has_images(inputs: Mapping[str, Any]) -> bool:
    """Whether a batch carries at least one image (``pixel_values`` present and not empty)."""
    pixels = inputs.get("pixel_values")
    return pixels is not None and pixels.numel() > 0


def with_blank_image(inputs: Mapping[str, Any], blank: BlankImage) -> dict[str, Any]:
    """``inputs`` (a padded batch with ``input_ids [B, L]`` and no images) with one blank image
    appended after position ``L - 1``: row 0 gets its image tokens, other rows padding; the new
    positions are 0 in ``attention_mask`` and ignored in ``labels``; every other ``[B, L]`` tensor
    is extended with zeros. The loss and the gradients are those of ``inputs``."""
    ids = inputs["input_ids"]
    rows, length = ids.shape
    extra = blank.tokens
    out: dict[str, Any] = dict(inputs)
    tail = torch.full((rows, extra), blank.pad_token_id, dtype=ids.dtype, device=ids.device)
    tail[0] = blank.image_token_id
    out["input_ids"] = torch.cat([ids, tail], dim=1)
    for key, value in inputs.items():
        if key == "input_ids" or not torch.is_tensor(value) or tuple(value.shape[:2]) != (rows, length):
            continue
        fill = IGNORE_INDEX if key in TARGET_KEYS else 0
        pad = torch.full((rows, extra, *value.shape[2:]), fill, dtype=value.dtype, device=value.device)
        out[key] = torch.cat([value, pad], dim=1)
    out["pixel_values"] = torch.zeros((1, *blank.pixel_shape), device=ids.device)
    return out


class BlankImageGuardMixin:
    """Put before ``transformers.Trainer`` in the bases: a training microbatch of a LLaVA model
    without images gets one blank image (:func:`with_blank_image`) before the Trainer's loss.
    :class:`~dflop_ds.hf_trainer.DFLOPTrainerMixin` includes it; alone it keeps any other sampler
    (the Trainer's own) from breaking ZeRO's reduction on image-free microbatches."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        config = getattr(getattr(self, "model", None), "config", None)
        self._blank_image = BlankImage.for_model(config)
        if self._blank_image is None and getattr(config, "vision_config", None) is not None:
            logger.warning(
                "no blank-image guard for model type %r (LLaVA only): under ZeRO-2/3 a microbatch without images"
                " on one rank beside images on another can abort the gradient reduction",
                getattr(config, "model_type", None),
            )

    def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's loss, after the blank image where a LLaVA training microbatch has none."""
        if self._blank_image is not None and model.training and "input_ids" in inputs and not has_images(inputs):
            inputs = with_blank_image(inputs, self._blank_image)
        return super().compute_loss(model, inputs, *args, **kwargs)  # type: ignore[misc]


__all__ = ["BlankImage", "BlankImageGuardMixin", "has_images", "with_blank_image"]
