"""What the Trainer path (:mod:`dflop_ds.hf_trainer`) asks of a model family, through the registry.

A user's HF model and collator run there, not the package's layer lists, so a family gives:

* the **blank image** its image-free guard sends through the tower (a microbatch without images
  under ZeRO-2/3 would otherwise skip the tower on one rank and break the gradient reduction): the
  ``pixel_values`` shape HF's model takes for one image, its image token and how many of them it
  becomes, and the extra per-image tensors the model needs (Qwen2-VL's grid, LLaVA-OneVision's size);
  and, for a family whose model runs the tower apart for videos, the **blank video** the guard
  pairs with it under ZeRO-3 (every rank then calls the tower as often);
* its **padding-free collation**: the per-sample media keys concatenated in sample order, which of
  them are padded to a common shape first (LLaVA-OneVision's tiles per image differ by image; HF
  slices each image's tiles by its ``image_sizes``), and (Qwen2-VL) the model's ``get_rope_index``
  for M-RoPE positions.

:func:`~dflop_ds.models.hf.registry.trainer_parts_of` looks the parts of a model's config up; a
model type no family registers gets None (the Trainer then runs without a guard and with
text-only positions).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: per-sample media of a padding-free batch when the family names none: concatenated along dim 0
DEFAULT_MEDIA_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")


@dataclass(frozen=True)
class BlankVideo:
    """What a model needs to take one blank video, for a family whose model runs its vision tower
    once for a microbatch's images and once more for its videos (Qwen2-VL, Qwen3-VL,
    LLaVA-OneVision): its ``pixel_values_videos`` shape, the video token and how many of them the
    video becomes, and (Qwen2-VL) its ``video_grid_thw`` row (its tokens are then typed as video
    tokens in ``mm_token_type_ids``)."""

    pixel_shape: tuple[int, ...]
    token_id: int
    tokens: int
    grid_thw: tuple[int, int, int] | None = None


@dataclass(frozen=True)
class BlankImage:
    """What a model needs to take one blank image: its ``pixel_values`` tensor shape, the image
    token and how many of them the image becomes, a token id for the other rows' padding,
    (Qwen2-VL) the image's ``image_grid_thw`` row (its tokens are then typed as image tokens in
    ``mm_token_type_ids``) and (LLaVA-OneVision) its ``image_sizes`` row ``(height, width)``.

    ``video``: the family's blank video where its model runs the tower apart for videos (None:
    one tower call takes a microbatch's images and videos, or the family has no videos)."""

    pixel_shape: tuple[int, ...]
    image_token_id: int
    tokens: int
    pad_token_id: int
    grid_thw: tuple[int, int, int] | None = None
    image_sizes: tuple[int, int] | None = None
    video: BlankVideo | None = None


def text_pad_token(config: Any, *media_token_ids: int) -> int:
    """The text model's padding id, or the smallest id that is no media token (the image token,
    and the video token of a family that takes videos)."""
    pad = getattr(config.get_text_config(), "pad_token_id", None)
    if pad is None or int(pad) in media_token_ids:
        return next(token for token in range(len(media_token_ids) + 1) if token not in media_token_ids)
    return int(pad)


def no_rope_index(model: Any) -> None:
    """A family whose padding-free positions are the text positions (no M-RoPE)."""
    return None


@dataclass(frozen=True)
class TrainerParts:
    """A family's pieces for the Trainer path.

    Attributes:
        blank_image: ``(config) ->`` the :class:`BlankImage` of the guard (None: none for this config).
        media_keys: per-sample media keys a padding-free batch concatenates along dim 0, in sample order.
        padded_keys: those of ``media_keys`` padded with zeros to the largest sample's shape first.
        rope_index: ``(model) ->`` the model's M-RoPE position function (``get_rope_index``), or None.
    """

    blank_image: Callable[[Any], BlankImage | None]
    media_keys: tuple[str, ...] = ("pixel_values",)
    padded_keys: tuple[str, ...] = ()
    rope_index: Callable[[Any], Callable[..., Any] | None] = no_rope_index


__all__ = ["DEFAULT_MEDIA_KEYS", "BlankImage", "BlankVideo", "TrainerParts", "no_rope_index", "text_pad_token"]
