"""A blank image for a LLaVA or Qwen2-VL microbatch that has none, so ZeRO's gradient reduction stays in step.

Under ZeRO-2/3 every data-parallel rank reduces its gradients in buckets filled in the order the
backward pass produces them. A microbatch without images skips the vision tower, so on that rank
the tower's parameters get no gradient and the ranks' reductions no longer match (a size mismatch
or, worse, gradients summed out of place). The project's own layers send a blank placeholder image
through the tower (``dflop_ds.models.hf.llava.VisionEmbeddings``, ``dflop_ds.models.hf.qwen2_vl.
PatchEmbedding``); for a user's HF model and collator, :func:`with_blank_image` does the same on the
batch: one blank image is appended after the last token of row 0 with its image tokens, masked out
of attention and of the loss. Causal attention keeps every real token from seeing it, so the loss
and every gradient are unchanged (the tower's gradient from it is exactly zero), while the
backward pass runs the same operations in the same order as on a rank with images.

Qwen2-VL (and Qwen2.5-VL) runs one tower for images and videos, so a microbatch with a video needs
nothing; its blank image is the placeholder grid ``[1, m, m]`` (one LLM token), with its
``image_grid_thw`` and ``mm_token_type_ids`` (the model's M-RoPE wants them), and a padding-free
batch's ``position_ids`` (``[B, L]`` or ``[3 or 4, B, L]``) are extended with zeros: the blank
tokens start sequences of their own.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from dflop_ds.models.hf.llava import MODEL_TYPE as LLAVA_TYPE
from dflop_ds.models.hf.qwen2_vl import MODEL_CLASSES as QWEN2_VL_CLASSES
from dflop_ds.models.hf.qwen2_vl import placeholder_grid
from dflop_ds.models.tiny_data import IGNORE_INDEX

logger = logging.getLogger(__name__)

#: batch keys that are per-token targets (filled with the ignore index where the blank image goes)
TARGET_KEYS = ("labels", "shift_labels")
#: batch keys that carry visual input: a batch with any of them non-empty runs the vision tower
VISUAL_KEYS = ("pixel_values", "pixel_values_videos")
#: Qwen2-VL's per-token modality key and its value for image tokens (text is 0, video 2)
TOKEN_TYPE_KEY, IMAGE_TOKEN_TYPE = "mm_token_type_ids", 1


@dataclass(frozen=True)
class BlankImage:
    """What a model needs to take one blank image: its ``pixel_values`` tensor shape, the image
    token and how many of them the image becomes, a token id for the other rows' padding, and
    (Qwen2-VL) the image's ``image_grid_thw`` row."""

    pixel_shape: tuple[int, ...]
    image_token_id: int
    tokens: int
    pad_token_id: int
    grid_thw: tuple[int, int, int] | None = None

    @classmethod
    def for_model(cls, config: Any) -> BlankImage | None:
        """The blank image of a ``LlavaForConditionalGeneration`` or Qwen2-VL / Qwen2.5-VL config;
        None for another model (the guard then does nothing)."""
        model_type = getattr(config, "model_type", None)
        if model_type == LLAVA_TYPE and isinstance(config.vision_feature_layer, int):
            return cls._llava(config)
        if model_type in QWEN2_VL_CLASSES:
            return cls._qwen2_vl(config)
        return None

    @classmethod
    def _llava(cls, config: Any) -> BlankImage:
        vision = config.vision_config
        patches = (int(vision.image_size) // int(vision.patch_size)) ** 2
        has_cls = str(vision.model_type).startswith("clip")
        tokens = patches + int(has_cls) - int(has_cls and config.vision_feature_select_strategy == "default")
        image_token_id = int(config.image_token_id)
        pixels = (1, int(vision.num_channels), int(vision.image_size), int(vision.image_size))
        return cls(pixels, image_token_id, tokens, _pad_token(config, image_token_id))

    @classmethod
    def _qwen2_vl(cls, config: Any) -> BlankImage:
        vision = config.vision_config
        merge = int(vision.spatial_merge_size)
        grid = placeholder_grid(merge, torch.empty(0))[0].tolist()
        patch_dim = int(vision.in_channels) * int(vision.temporal_patch_size) * int(vision.patch_size) ** 2
        image_token_id = int(config.image_token_id)
        return cls((merge**2, patch_dim), image_token_id, 1, _pad_token(config, image_token_id), tuple(grid))


def _pad_token(config: Any, image_token_id: int) -> int:
    """The text model's padding id, or another id that is not the image token."""
    pad = getattr(config.text_config, "pad_token_id", None)
    if pad is None or int(pad) == image_token_id:
        return 0 if image_token_id != 0 else 1
    return int(pad)


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
    """Put before ``transformers.Trainer`` in the bases: a training microbatch of a LLaVA or
    Qwen2-VL model without images (or videos) gets one blank image (:func:`with_blank_image`) before the Trainer's loss.
    :class:`~dflop_ds.hf_trainer.DFLOPTrainerMixin` includes it; alone it keeps any other sampler
    (the Trainer's own) from breaking ZeRO's reduction on image-free microbatches."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        config = getattr(getattr(self, "model", None), "config", None)
        self._blank_image = BlankImage.for_model(config)
        if self._blank_image is None and getattr(config, "vision_config", None) is not None:
            logger.warning(
                "no blank-image guard for model type %r (LLaVA and Qwen2-VL only): under ZeRO-2/3 a microbatch"
                " without images on one rank beside images on another can abort the gradient reduction",
                getattr(config, "model_type", None),
            )

    def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's loss, after the blank image where a training microbatch has no visual input."""
        return super().compute_loss(model, guarded_batch(model, inputs, self._blank_image), *args, **kwargs)  # type: ignore[misc]


__all__ = ["BlankImage", "BlankImageGuardMixin", "guarded_batch", "has_images", "with_blank_image"]
