"""The Qwen2-VL family (``Qwen2VLForConditionalGeneration``, ``Qwen2_5_VLForConditionalGeneration``)
as a registered :class:`~dflop_ds.models.hf.registry.ModelFamily`: its adapter
(:mod:`~dflop_ds.models.hf.qwen2_vl.model`), data pipeline (:mod:`~dflop_ds.models.hf.qwen2_vl.data`) and
synthetic microbatches (:mod:`~dflop_ds.models.hf.qwen2_vl.synthetic`)."""

from __future__ import annotations

from typing import Any

from dflop_ds.data.video import DEFAULT_VIDEO_FPS, DEFAULT_VIDEO_MAX_FRAMES
from dflop_ds.models.hf.base.family import hf_family
from dflop_ds.models.hf.base.patch_grid_family import patch_grid_trainer, patch_grid_vision_states
from dflop_ds.models.hf.check import video_image_text_batches
from dflop_ds.models.hf.qwen2_vl.data import (
    Qwen2VLDataset,
    Qwen2VLPreprocessor,
    collate_packed_qwen2_vl,
    collate_qwen2_vl,
)
from dflop_ds.models.hf.qwen2_vl.model import (
    MODEL_CLASSES,
    MODEL_TYPE,
    MRopeLLMInputs,
    Qwen2VLEncoderInputs,
    load_qwen2_vl,
    qwen2_vl_layers,
    tower_grid,
)
from dflop_ds.models.hf.qwen2_vl.synthetic import IMAGE_MARK, VIDEO_MARK, Qwen2VLInputs, qwen2_vl_hf_kwargs


def qwen2_vl_preprocessor(
    model_dir: str,
    *,
    max_length: int | None = None,
    truncation: str = "error",
    video_fps: float = DEFAULT_VIDEO_FPS,
    video_max_frames: int = DEFAULT_VIDEO_MAX_FRAMES,
) -> Qwen2VLPreprocessor:
    """The :class:`~dflop_ds.models.hf.qwen2_vl.data.Qwen2VLPreprocessor` of ``model_dir``."""
    return Qwen2VLPreprocessor.from_pretrained(
        model_dir, video_fps=video_fps, video_max_frames=video_max_frames, max_length=max_length, truncation=truncation
    )


def qwen2_vl_vision_states(model: Any, inputs: tuple) -> Any:
    """The HF tower's hidden states of a microbatch's images and videos (check-model)."""
    pixel_values, _, _, image_grid, video_grid = inputs
    return patch_grid_vision_states(model, pixel_values, tower_grid(image_grid, video_grid))


#: Under LoRA the patch merger (the projector) trains in full, as LLaVA's projector does; its patches
#: cannot be dispatched to a colocated encoder yet. The encoder sweep's "tiles" are patches, the
#: policy's encoder units. Check-model adds a video microbatch (Qwen2-VL only: Qwen2.5-VL's videos
#: are not supported yet).
FAMILY = hf_family(
    "Qwen2-VL",
    tuple(MODEL_CLASSES),
    ("models/hf/qwen2_vl/", "testing/qwen2_vl_tiny.py"),
    load=load_qwen2_vl,
    layers=qwen2_vl_layers,
    projector_name="visual.merger",
    dataset=Qwen2VLDataset,
    collate=collate_qwen2_vl,
    packed_collate=collate_packed_qwen2_vl,
    encoder_inputs=Qwen2VLEncoderInputs,
    llm_inputs=MRopeLLMInputs,
    microbatches=lambda path, config: Qwen2VLInputs.from_dir(path, config).microbatch,
    image_mark=IMAGE_MARK,
    hf_kwargs=lambda model, inputs: qwen2_vl_hf_kwargs(inputs, model.config),
    vision_states=qwen2_vl_vision_states,
    extra_batches=video_image_text_batches(IMAGE_MARK, VIDEO_MARK, frames=4, model_types=(MODEL_TYPE,)),
    preprocessor=qwen2_vl_preprocessor,
    trainer=patch_grid_trainer,
    tensor_parallel=False,  # AutoTP with M-RoPE decoder layers is untested
)

__all__ = ["FAMILY", "qwen2_vl_preprocessor"]
