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
extended with zeros: the blank tokens start sequences of their own.

HF's Qwen2-VL, Qwen3-VL and LLaVA-OneVision run the vision tower once for a microbatch's images
and once more for its videos. Under ZeRO-3 (and FSDP) each run gathers the tower's parameters, a
collective, so a rank with images and videos would gather twice while a rank with images alone
gathers once, and the ranks' collectives no longer match (gloo: ``Received data size doesn't match
expected size``). There the guard also completes each microbatch's pair: the family's blank video
(:class:`~dflop_ds.models.hf.trainer_parts.BlankVideo`: a one-step Qwen2-VL video, a one-frame
LLaVA-OneVision video) where it has no video (:func:`with_blank_video`), a blank image where it
has videos alone, so that every rank runs the tower twice in the same order. A
:class:`~dflop_ds.hf_trainer.DFLOPTrainer` whose shape table (the shape helpers') counts no video
in the data skips the pairing: no microbatch calls the tower a second time.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from dflop_ds.models.hf.registry import trainer_parts_of
from dflop_ds.models.hf.trainer_parts import BlankImage, BlankVideo
from dflop_ds.models.tiny_data import IGNORE_INDEX

logger = logging.getLogger(__name__)

#: batch keys that are per-token targets (filled with the ignore index where the blank image goes)
TARGET_KEYS = ("labels", "shift_labels")
#: batch keys that carry visual input: a batch with any of them non-empty runs the vision tower
VISUAL_KEYS = ("pixel_values", "pixel_values_videos")
#: Qwen2-VL's per-token modality key and its values for image and video tokens (text is 0)
TOKEN_TYPE_KEY, IMAGE_TOKEN_TYPE, VIDEO_TOKEN_TYPE = "mm_token_type_ids", 1, 2


def blank_image_for(config: Any) -> BlankImage | None:
    """The blank image of a model's config, from its family in the registry; None for a model no
    family registers, or a config its family gives none for (the guard then does nothing)."""
    parts = trainer_parts_of(config)
    return None if parts is None else parts.blank_image(config)


def has_media(inputs: Mapping[str, Any], key: str) -> bool:
    """Whether ``inputs[key]`` is present and not empty."""
    return inputs.get(key) is not None and inputs[key].numel() > 0


def has_images(inputs: Mapping[str, Any]) -> bool:
    """Whether a batch carries visual input: ``pixel_values`` or ``pixel_values_videos`` present
    and not empty."""
    return any(has_media(inputs, key) for key in VISUAL_KEYS)


def with_blank_image(inputs: Mapping[str, Any], blank: BlankImage) -> dict[str, Any]:
    """``inputs`` (a batch with ``input_ids [B, L]`` and no images) with one blank image
    appended after position ``L - 1``: row 0 gets its image tokens, other rows padding; the new
    positions are 0 in ``attention_mask`` and ``position_ids``, ignored in ``labels``, a sample of
    their own in a padding-free batch's ``cu_seq_lens_q/k``; every other ``[B, L]`` tensor is
    extended with zeros. The loss and the gradients are those of ``inputs``."""
    typed = IMAGE_TOKEN_TYPE if blank.grid_thw is not None else None
    out = _with_blank_tokens(
        inputs, pad=blank.pad_token_id, token=blank.image_token_id, count=blank.tokens, typed=typed
    )
    ids = out["input_ids"]
    out["pixel_values"] = torch.zeros(blank.pixel_shape, device=ids.device)
    if blank.image_sizes is not None:
        out["image_sizes"] = torch.tensor([blank.image_sizes], dtype=torch.long, device=ids.device)
    if "batch_num_images" in inputs:  # images per row: the blank one is row 0's
        rows = ids.shape[0]
        out["batch_num_images"] = torch.tensor([1] + [0] * (rows - 1), dtype=torch.long, device=ids.device)
    if blank.grid_thw is not None:
        out["image_grid_thw"] = torch.tensor([blank.grid_thw], dtype=torch.long, device=ids.device)
    return out


def with_blank_video(inputs: Mapping[str, Any], blank: BlankImage) -> dict[str, Any]:
    """``inputs`` (a batch with ``input_ids [B, L]`` and no videos) with the family's blank video
    (``blank.video``) appended after position ``L - 1``, the rest as :func:`with_blank_image` does it."""
    video: BlankVideo | None = blank.video
    if video is None:
        raise ValueError("this model family takes no blank video: its tower runs once for images and videos")
    typed = VIDEO_TOKEN_TYPE if video.grid_thw is not None else None
    out = _with_blank_tokens(inputs, pad=blank.pad_token_id, token=video.token_id, count=video.tokens, typed=typed)
    device = out["input_ids"].device
    out["pixel_values_videos"] = torch.zeros(video.pixel_shape, device=device)
    if video.grid_thw is not None:
        out["video_grid_thw"] = torch.tensor([video.grid_thw], dtype=torch.long, device=device)
    return out


def _with_blank_tokens(
    inputs: Mapping[str, Any], *, pad: int, token: int, count: int, typed: int | None
) -> dict[str, Any]:
    """``inputs`` with ``count`` tokens ``token`` appended to row 0 (``pad`` on the other rows),
    masked out of attention and of the loss (see :func:`with_blank_image`), typed ``typed`` in
    ``mm_token_type_ids`` when the family types its tokens (not None)."""
    ids = inputs["input_ids"]
    rows, length = ids.shape
    out: dict[str, Any] = dict(inputs)
    tail = torch.full((rows, count), pad, dtype=ids.dtype, device=ids.device)
    tail[0] = token
    out["input_ids"] = torch.cat([ids, tail], dim=1)
    for key, value in inputs.items():
        if key == "input_ids" or not torch.is_tensor(value):
            continue
        if key == "position_ids" and value.dim() == 3 and tuple(value.shape[1:]) == (rows, length):
            out[key] = torch.cat([value, value.new_zeros((*value.shape[:2], count))], dim=2)
        elif tuple(value.shape[:2]) == (rows, length):
            fill = IGNORE_INDEX if key in TARGET_KEYS else 0
            filler = torch.full((rows, count, *value.shape[2:]), fill, dtype=value.dtype, device=value.device)
            out[key] = torch.cat([value, filler], dim=1)
    if "cu_seq_lens_q" in inputs:  # a padding-free batch's sample bounds: the blank media are one more sample
        for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
            bounds = inputs[key]
            out[key] = torch.cat([bounds, bounds[-1:] + count])
        for key in ("max_length_q", "max_length_k"):
            out[key] = max(int(inputs[key]), count)
    if typed is not None:
        types = out.get(TOKEN_TYPE_KEY)
        if types is None:
            types = torch.zeros_like(out["input_ids"], dtype=torch.int)
        types = types.clone()
        types[0, length:] = typed
        out[TOKEN_TYPE_KEY] = types
    return out


def guarded_batch(model: Any, inputs: Any, blank: BlankImage | None, pair_videos: bool = False) -> Any:
    """``inputs`` with :func:`with_blank_image` when ``model`` trains on a microbatch without visual
    input and ``blank`` is its blank image; when ``pair_videos`` (the engine gathers parameters per
    call: ZeRO-3, FSDP; and the data may hold videos) and the family runs its tower apart for
    videos (``blank.video``), with a blank image where the microbatch has none and a blank video
    where it has none; else ``inputs`` unchanged."""
    if blank is None or not model.training or "input_ids" not in inputs:
        return inputs
    if not (pair_videos and blank.video is not None):
        return inputs if has_images(inputs) else with_blank_image(inputs, blank)
    out = inputs if has_media(inputs, "pixel_values") else with_blank_image(inputs, blank)
    return out if has_media(out, "pixel_values_videos") else with_blank_video(out, blank)


def gathers_parameters_per_call(trainer: Any) -> bool:
    """Whether ``trainer``'s engine gathers a module's parameters on every call of it: DeepSpeed
    ZeRO-3 or FSDP."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    return bool(is_deepspeed_zero3_enabled() or getattr(trainer, "is_fsdp_enabled", False))


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
        #: whether every microbatch gets both a blank image and a blank video where it lacks them
        #: (per-call gathers; a subclass that knows the data holds no video turns it off)
        self._pair_videos = gathers_parameters_per_call(self)
        if self._blank_image is None and getattr(config, "vision_config", None) is not None:
            logger.warning(
                "no blank-image guard for model type %r (no registered family gives one for this config): under"
                " ZeRO-2/3 a microbatch without images on one rank beside images on another can abort the gradient"
                " reduction",
                getattr(config, "model_type", None),
            )

    def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's loss, after the blank image where a training microbatch has no visual input."""
        guarded = guarded_batch(model, inputs, self._blank_image, self._pair_videos)
        return super().compute_loss(model, guarded, *args, **kwargs)  # type: ignore[misc]


__all__ = [
    "BlankImage",
    "BlankVideo",
    "BlankImageGuardMixin",
    "blank_image_for",
    "gathers_parameters_per_call",
    "guarded_batch",
    "has_images",
    "with_blank_image",
    "with_blank_video",
]
