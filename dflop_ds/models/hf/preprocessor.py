"""The data preprocessor of a HuggingFace model directory: its family's tokenization template,
image (and video) processing and length rule, chosen by the directory's ``model_type``
(:func:`~dflop_ds.models.hf.registry.family_of`)."""

from __future__ import annotations

from typing import Any

from dflop_ds.data.video import DEFAULT_VIDEO_FPS, DEFAULT_VIDEO_MAX_FRAMES
from dflop_ds.models.hf.base.folder import check_model_folder
from dflop_ds.models.hf.registry import ModelFamily, family_of


def family_preprocessor(
    model_dir: str,
    *,
    max_length: int | None = None,
    truncation: str = "error",
    video_fps: float = DEFAULT_VIDEO_FPS,
    video_max_frames: int = DEFAULT_VIDEO_MAX_FRAMES,
) -> tuple[ModelFamily, Any]:
    """``(family, preprocessor)`` of ``model_dir``, its ``config.json`` read once (a folder without
    config or tokenizer is named first); ``video_fps`` / ``video_max_frames`` apply to families
    that take videos. Training, profiling and the data commands all build theirs here."""
    check_model_folder(model_dir, weights=False)
    family = family_of(model_dir)
    preprocessor = family.preprocessor(
        model_dir, max_length=max_length, truncation=truncation, video_fps=video_fps, video_max_frames=video_max_frames
    )
    return family, preprocessor


def hf_preprocessor(model_dir: str, **settings: Any) -> Any:
    """The preprocessor of ``model_dir``'s family (:func:`family_preprocessor`, same settings)."""
    return family_preprocessor(model_dir, **settings)[1]


__all__ = ["family_preprocessor", "hf_preprocessor"]
