"""The data preprocessor of a HuggingFace model directory: its family's tokenization template,
image (and video) processing and length rule, chosen by the directory's ``model_type``
(:func:`~dflop_ds.models.hf.registry.family_of`)."""

from __future__ import annotations

from typing import Any

from dflop_ds.data.video import DEFAULT_VIDEO_FPS, DEFAULT_VIDEO_MAX_FRAMES
from dflop_ds.models.hf.base.folder import check_model_folder
from dflop_ds.models.hf.registry import family_of


def hf_preprocessor(
    model_dir: str,
    *,
    max_length: int | None = None,
    truncation: str = "error",
    video_fps: float = DEFAULT_VIDEO_FPS,
    video_max_frames: int = DEFAULT_VIDEO_MAX_FRAMES,
) -> Any:
    """The preprocessor of ``model_dir``'s family (a folder without config or tokenizer is named
    first); ``video_fps`` / ``video_max_frames`` apply to families that take videos. Training and
    the data commands both build theirs here."""
    check_model_folder(model_dir, weights=False)
    return family_of(model_dir).preprocessor(
        model_dir, max_length=max_length, truncation=truncation, video_fps=video_fps, video_max_frames=video_max_frames
    )
