"""What the registrations of the tiling families (LLaVA-OneVision, InternVL) share: their
preprocessor loader and ``check-model`` parts are the same recipe over each family's own loader,
layer lists, input classes and marks, which the family modules pass in."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from dflop_ds.data.video import DEFAULT_VIDEO_MAX_FRAMES
from dflop_ds.models.hf.base.tiled_data import TiledPreprocessor
from dflop_ds.models.hf.check import tower_hidden_states, video_image_text_batches
from dflop_ds.models.hf.check_parts import CheckParts, MicrobatchBuilder

Tiled = TypeVar("Tiled", bound=TiledPreprocessor)


def tiled_preprocessor_loader(cls: type[Tiled]) -> Callable[..., Tiled]:
    """The family's ``preprocessor`` entry: ``(model_dir, *, max_length, truncation, video_max_frames,
    **video) ->`` ``cls.from_pretrained(...)`` (frames are sampled uniformly, so the frame rate in
    ``video`` does not apply)."""

    def load(
        model_dir: str,
        *,
        max_length: int | None = None,
        truncation: str = "error",
        video_max_frames: int = DEFAULT_VIDEO_MAX_FRAMES,
        **video: Any,
    ) -> Tiled:
        return cls.from_pretrained(
            model_dir, max_length=max_length, truncation=truncation, video_max_frames=video_max_frames
        )

    return load


def tiled_check_parts(
    load: Callable[[Path], Any],
    layers: Callable[[Any], tuple[list, Any, list]],
    inputs_from_dir: Callable[[Path, Any], Any],
    hf_kwargs: Callable[[tuple], dict],
    image_mark: str,
    video_mark: str,
) -> CheckParts:
    """``check-model`` parts of a tiling family: microbatches from its synthetic inputs
    (``inputs_from_dir(path, config).microbatch``), the tower's hidden states of the tiles as they
    are, and a video row besides the image and text rows."""

    def microbatches(path: Path, config: Any) -> MicrobatchBuilder:
        return inputs_from_dir(path, config).microbatch

    return CheckParts(
        load,
        layers,
        microbatches,
        image_mark,
        lambda model, inputs: hf_kwargs(inputs),
        tower_hidden_states,
        video_image_text_batches(image_mark, video_mark),
    )


__all__ = ["tiled_check_parts", "tiled_preprocessor_loader"]
