"""The Qwen3-VL family (``Qwen3VLForConditionalGeneration``) as a registered
:class:`~dflop_ds.models.hf.registry.ModelFamily`: its adapter (:mod:`~dflop_ds.models.hf.qwen3_vl.model`:
deepstack features carried with the microbatch), data pipeline (:mod:`~dflop_ds.models.hf.qwen3_vl.data`)
and synthetic microbatches (:mod:`~dflop_ds.models.hf.qwen3_vl.synthetic`). Images only: videos are
refused by name."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from dflop_ds.models.hf.base.folder import save_text_and_image_parts
from dflop_ds.models.hf.base.patch_grid_family import patch_grid_trainer, patch_grid_vision_states
from dflop_ds.models.hf.check_parts import CheckParts, MicrobatchBuilder
from dflop_ds.models.hf.profile import family_profile_target
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
    load_qwen3_vl,
    qwen3_vl_layers,
)
from dflop_ds.models.hf.qwen3_vl.synthetic import IMAGE_MARK, Qwen3VLInputs, qwen3_vl_hf_kwargs
from dflop_ds.models.hf.registry import ModelFamily
from dflop_ds.models.hf.training import TrainingParts


def qwen3_vl_preprocessor(model_dir: str, **kwargs: Any) -> Qwen3VLPreprocessor:
    """The :class:`~dflop_ds.models.hf.qwen3_vl.data.Qwen3VLPreprocessor` of ``model_dir``
    (``max_length``, ``truncation``, ``video_fps``, ``video_max_frames`` as for every family)."""
    return Qwen3VLPreprocessor.from_pretrained(model_dir, **kwargs)


def qwen3_vl_training() -> TrainingParts:
    """Qwen3-VL's training pieces: under LoRA the patch merger (the projector) trains in full; its
    patches cannot be dispatched to a colocated encoder yet."""
    return TrainingParts(
        load_qwen3_vl,
        qwen3_vl_layers,
        "visual.merger",
        Qwen3VLDataset,
        collate_qwen3_vl,
        save_text_and_image_parts,
        packed_collate=collate_packed_qwen3_vl,
    )


#: The layer lists, input factories and shape policy of the Qwen3-VL model in a directory (the
#: encoder sweep's "tiles" are patches, the policy's encoder units).
qwen3_vl_target = partial(
    family_profile_target,
    load=load_qwen3_vl,
    layers=qwen3_vl_layers,
    encoder_inputs=Qwen3VLEncoderInputs,
    llm_inputs=DeepstackLLMInputs,
)


def qwen3_vl_check() -> CheckParts:
    """Qwen3-VL's check-model parts (images and text; no videos)."""

    def microbatches(path: Path, config: Any) -> MicrobatchBuilder:
        return Qwen3VLInputs.from_dir(path, config).microbatch

    def vision_states(model: Any, inputs: tuple) -> Any:
        pixel_values, _, _, grid = inputs
        return patch_grid_vision_states(model, pixel_values, grid)

    return CheckParts(
        load_qwen3_vl,
        qwen3_vl_layers,
        microbatches,
        IMAGE_MARK,
        lambda model, inputs: qwen3_vl_hf_kwargs(inputs, model.config),
        vision_states,
    )


FAMILY = ModelFamily(
    name="Qwen3-VL",
    model_types=(MODEL_TYPE,),
    files=("models/hf/qwen3_vl/", "testing/qwen3_vl_tiny.py"),
    preprocessor=qwen3_vl_preprocessor,
    training=qwen3_vl_training,
    profile_target=qwen3_vl_target,
    check_parts=qwen3_vl_check,
    trainer=patch_grid_trainer,
    tensor_parallel=False,  # AutoTP with deepstack decoder layers is untested
)

__all__ = ["FAMILY", "qwen3_vl_check", "qwen3_vl_preprocessor", "qwen3_vl_target", "qwen3_vl_training"]
