"""A HuggingFace ``save_pretrained`` directory as a training-loop :class:`ModelSource`, built from
its family's training pieces (:func:`~dflop_ds.models.hf.preprocessor.family_preprocessor`,
:func:`~dflop_ds.models.hf.training.training_source`)."""

from __future__ import annotations

from dflop_ds.data.video import DEFAULT_VIDEO_FPS, DEFAULT_VIDEO_MAX_FRAMES
from dflop_ds.models.hf.lora import LoraSettings
from dflop_ds.models.hf.preprocessor import family_preprocessor
from dflop_ds.models.hf.training import training_source
from dflop_ds.models.source import ModelSource


def hf_source(
    model_dir: str,
    *,
    image_folder: str | None = None,
    lora: LoraSettings | None = None,
    max_length: int | None = None,
    truncation: str = "error",
    video_folder: str | None = None,
    video_fps: float = DEFAULT_VIDEO_FPS,
    video_max_frames: int = DEFAULT_VIDEO_MAX_FRAMES,
) -> ModelSource:
    """The model, processor and data pipeline of a HuggingFace directory for the training loop.

    Args:
        model_dir: a ``save_pretrained`` directory of the model with its processor.
        image_folder: folder the records' image paths are relative to (default: the data
            file's folder).
        lora: LoRA settings for the language model (:class:`~dflop_ds.models.hf.lora.LoraSettings`);
            None trains all weights.
        max_length, truncation: sequence-length rule of the tokenization.
        video_folder: folder the records' video paths are relative to (default: the data file's
            folder); families without videos refuse them.
        video_fps, video_max_frames: how a family that takes videos samples their frames.
    """
    family, preprocessor = family_preprocessor(
        model_dir, max_length=max_length, truncation=truncation, video_fps=video_fps, video_max_frames=video_max_frames
    )
    return training_source(
        model_dir,
        family.training(),
        preprocessor,
        image_folder=image_folder,
        lora=lora,
        video_folder=video_folder,
    )
