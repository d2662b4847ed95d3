"""The Qwen3-VL family (``Qwen3VLForConditionalGeneration``) as a registered
:class:`~dflop_ds.models.hf.registry.ModelFamily`: its adapter (:mod:`~dflop_ds.models.hf.qwen3_vl.model`:
deepstack features carried with the microbatch), data pipeline (:mod:`~dflop_ds.models.hf.qwen3_vl.data`)
and synthetic microbatches (:mod:`~dflop_ds.models.hf.qwen3_vl.synthetic`); videos are written with
their frame groups' timestamps (:mod:`~dflop_ds.models.hf.qwen3_vl.shapes`)."""

from __future__ import annotations

from typing import Any

from dflop_ds.models.hf.base.family import hf_family
from dflop_ds.models.hf.base.patch_grid_family import patch_grid_trainer, patch_grid_vision_states
from dflop_ds.models.hf.check import video_image_text_batches
from dflop_ds.models.hf.qwen3_vl.data import (
    Qwen3VLDataset,
    Qwen3VLPreprocessor,
    collate_packed_qwen3_vl,
    collate_qwen3_vl,
)
from dflop_ds.models.hf.qwen3_vl.model import (
    MODEL_TYPE,
    DeepstackLLMInputs,
    Qwen3VLEncoderInputs,
    frame_grids,
    load_qwen3_vl,
    qwen3_vl_layers,
    tower_grid,
)
from dflop_ds.models.hf.qwen3_vl.synthetic import IMAGE_MARK, VIDEO_MARK, Qwen3VLInputs, qwen3_vl_hf_kwargs


def qwen3_vl_preprocessor(model_dir: str, **kwargs: Any) -> Qwen3VLPreprocessor:
    """The :class:`~dflop_ds.models.hf.qwen3_vl.data.Qwen3VLPreprocessor` of ``model_dir``
    (``max_length``, ``truncation``, ``video_fps``, ``video_max_frames`` as for every family)."""
    return Qwen3VLPreprocessor.from_pretrained(model_dir, **kwargs)


def qwen3_vl_vision_states(model: Any, inputs: tuple) -> Any:
    """The HF tower's hidden states of a microbatch's images and videos' frame groups (check-model)."""
    pixel_values, _, _, grid, video_grid = inputs
    return patch_grid_vision_states(model, pixel_values, tower_grid(grid, frame_grids(video_grid)))


#: Under LoRA the patch merger (the projector) trains in full; its patches cannot be dispatched to a
#: colocated encoder yet. The encoder sweep's "tiles" are patches, the policy's encoder units.
#: Check-model adds a video microbatch.
FAMILY = hf_family(
    "Qwen3-VL",
    (MODEL_TYPE,),
    ("models/hf/qwen3_vl/", "testing/qwen3_vl_tiny.py"),
    load=load_qwen3_vl,
    layers=qwen3_vl_layers,
    projector_name="visual.merger",
    dataset=Qwen3VLDataset,
    collate=collate_qwen3_vl,
    packed_collate=collate_packed_qwen3_vl,
    encoder_inputs=Qwen3VLEncoderInputs,
    llm_inputs=DeepstackLLMInputs,
    microbatches=lambda path, config: Qwen3VLInputs.from_dir(path, config).microbatch,
    image_mark=IMAGE_MARK,
    hf_kwargs=lambda model, inputs: qwen3_vl_hf_kwargs(inputs, model.config),
    vision_states=qwen3_vl_vision_states,
    extra_batches=video_image_text_batches(IMAGE_MARK, VIDEO_MARK, frames=4),
    preprocessor=qwen3_vl_preprocessor,
    trainer=patch_grid_trainer,
    tensor_parallel=False,  # AutoTP with deepstack decoder layers is untested
)

__all__ = ["FAMILY", "qwen3_vl_preprocessor"]
