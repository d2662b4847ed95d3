"""A HuggingFace ``save_pretrained`` directory as a training-loop :class:`ModelSource`: LLaVA
here, the Qwen2-VL family in :mod:`~dflop_ds.models.hf.qwen2_vl_source`, both through
:func:`~dflop_ds.models.hf.family.family_source`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dflop_ds.data.video import DEFAULT_VIDEO_FPS, DEFAULT_VIDEO_MAX_FRAMES
from dflop_ds.models.hf.common import model_type
from dflop_ds.models.hf.data import (
    LlavaDataset,
    LlavaPreprocessor,
    collate_llava,
    collate_packed_llava,
    llava_policy,
)
from dflop_ds.models.hf.family import HFFamily, family_source
from dflop_ds.models.hf.llava import llava_layers, load_llava
from dflop_ds.models.hf.qwen2_vl import MODEL_CLASSES
from dflop_ds.models.hf.qwen2_vl_data import Qwen2VLPreprocessor
from dflop_ds.models.hf.qwen2_vl_source import qwen2_vl_source
from dflop_ds.models.source import ModelSource
from dflop_ds.shapes import ShapePolicy


def hf_policy(model_dir: str, *, max_length: int | None = None) -> ShapePolicy:
    """The shape policy of a HuggingFace ``save_pretrained`` directory's processor: the Qwen2-VL
    family's or LLaVA's, chosen by the config's model type (the one dispatch for both)."""
    if model_type(model_dir) in MODEL_CLASSES:
        if max_length is not None:
            raise ValueError(f"{model_dir}: a max_length is not supported for Qwen2-VL yet")
        return Qwen2VLPreprocessor.from_pretrained(model_dir).policy()
    return llava_policy(model_dir, max_length=max_length)


def hf_source(
    model_dir: str,
    *,
    image_folder: str | None = None,
    lora: Mapping[str, Any] | None = None,
    max_length: int | None = None,
    truncation: str = "error",
    video_folder: str | None = None,
    video_fps: float = DEFAULT_VIDEO_FPS,
    video_max_frames: int = DEFAULT_VIDEO_MAX_FRAMES,
) -> ModelSource:
    """The model, processor and data pipeline of a HuggingFace directory for the training loop:
    a ``LlavaForConditionalGeneration`` here, the Qwen2-VL family through
    :func:`~dflop_ds.models.hf.qwen2_vl_source.qwen2_vl_source`.

    Args:
        model_dir: a ``save_pretrained`` directory of the model with its processor.
        image_folder: folder the records' image paths are relative to (default: the data
            file's folder).
        lora: LoRA settings for the language model (see :func:`dflop_ds.models.hf.lora.apply_lora`);
            None trains all weights.
        max_length, truncation: sequence-length rule of the tokenization
            (:class:`~dflop_ds.models.hf.data.LlavaPreprocessor`).
        video_folder: folder the records' video paths are relative to (default: the data file's
            folder); LLaVA models refuse videos.
        video_fps, video_max_frames: how a Qwen2-VL model samples video frames
            (:class:`~dflop_ds.models.hf.qwen2_vl_data.VideoFrames`).
    """
    if model_type(model_dir) in MODEL_CLASSES:  # the Qwen2-VL family has its own preprocessor
        return qwen2_vl_source(
            model_dir,
            image_folder=image_folder,
            lora=lora,
            video_folder=video_folder,
            video_fps=video_fps,
            video_max_frames=video_max_frames,
            max_length=max_length,
            truncation=truncation,
        )
    family = HFFamily(
        load_llava,
        llava_layers,
        "multi_modal_projector",
        LlavaDataset,
        collate_llava,
        lambda pre, directory: pre.processor.save_pretrained(directory),
        tile_pixels=lambda item: item.pixel_values,  # one tile per image
        packed_collate=collate_packed_llava,
    )
    preprocessor = LlavaPreprocessor.from_pretrained(model_dir, max_length=max_length, truncation=truncation)
    return family_source(
        model_dir, family, preprocessor, image_folder=image_folder, lora=lora, video_folder=video_folder
    )
