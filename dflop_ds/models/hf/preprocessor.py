"""The data preprocessor of a HuggingFace model directory: its family's tokenization template,
image (and video) processing and length rule, chosen by the directory's ``model_type``."""

from __future__ import annotations

from typing import Any

from dflop_ds.data.video import DEFAULT_VIDEO_FPS, DEFAULT_VIDEO_MAX_FRAMES
from dflop_ds.models.hf.common import model_type
from dflop_ds.models.hf.data import LlavaPreprocessor
from dflop_ds.models.hf.qwen2_vl import MODEL_CLASSES
from dflop_ds.models.hf.qwen2_vl_data import Qwen2VLPreprocessor


def hf_preprocessor(
    model_dir: str,
    *,
    max_length: int | None = None,
    truncation: str = "error",
    video_fps: float = DEFAULT_VIDEO_FPS,
    video_max_frames: int = DEFAULT_VIDEO_MAX_FRAMES,
) -> Any:
    """A :class:`~dflop_ds.models.hf.qwen2_vl_data.Qwen2VLPreprocessor` for a Qwen2-VL directory,
    else a :class:`~dflop_ds.models.hf.data.LlavaPreprocessor` (which takes no videos, so the video
    rule does not apply to it); training and the data commands both build theirs here."""
    if model_type(model_dir) in MODEL_CLASSES:
        return Qwen2VLPreprocessor.from_pretrained(
            model_dir,
            video_fps=video_fps,
            video_max_frames=video_max_frames,
            max_length=max_length,
            truncation=truncation,
        )
    return LlavaPreprocessor.from_pretrained(model_dir, max_length=max_length, truncation=truncation)
