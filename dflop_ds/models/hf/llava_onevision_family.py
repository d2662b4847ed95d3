"""The LLaVA-OneVision family (``LlavaOnevisionForConditionalGeneration``: AnyRes tiles, multi-image
and video samples) as a registered :class:`~dflop_ds.models.hf.registry.ModelFamily`: its adapter
(:mod:`~dflop_ds.models.hf.llava_onevision`), counting rule (:mod:`~dflop_ds.models.hf.llava_onevision_shapes`),
data pipeline (:mod:`~dflop_ds.models.hf.llava_onevision_data`) and synthetic microbatches
(:mod:`~dflop_ds.models.hf.llava_onevision_synthetic`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflop_ds.data.video import DEFAULT_VIDEO_MAX_FRAMES
from dflop_ds.models.hf.check import tower_hidden_states, video_image_text_batches
from dflop_ds.models.hf.check_parts import CheckParts, MicrobatchBuilder
from dflop_ds.models.hf.folder import save_text_and_image_parts
from dflop_ds.models.hf.llava_onevision import (
    MODEL_TYPE,
    OnevisionEncoderInputs,
    llava_onevision_layers,
    load_llava_onevision,
)
from dflop_ds.models.hf.llava_onevision_data import (
    OnevisionDataset,
    OnevisionPreprocessor,
    collate_onevision,
    collate_packed_onevision,
)
from dflop_ds.models.hf.llava_onevision_synthetic import IMAGE_MARK, VIDEO_MARK, OnevisionInputs, onevision_hf_kwargs
from dflop_ds.models.hf.registry import ModelFamily
from dflop_ds.models.hf.training import TrainingParts
from dflop_ds.profile.inputs import ContractLLMInputs
from dflop_ds.profile.target import ProfileTarget, summed_cross_entropy


def llava_onevision_preprocessor(
    model_dir: str,
    *,
    max_length: int | None = None,
    truncation: str = "error",
    video_max_frames: int = DEFAULT_VIDEO_MAX_FRAMES,
    **video: Any,
) -> OnevisionPreprocessor:
    """The :class:`~dflop_ds.models.hf.llava_onevision_data.OnevisionPreprocessor` of ``model_dir``
    (frames are sampled uniformly, so the frame rate in ``video`` does not apply)."""
    return OnevisionPreprocessor.from_pretrained(
        model_dir, max_length=max_length, truncation=truncation, video_max_frames=video_max_frames
    )


def llava_onevision_training() -> TrainingParts:
    """LLaVA-OneVision's training pieces: under LoRA the projector trains in full, as LLaVA's does;
    its tiles cannot be dispatched to a colocated encoder yet (the projector needs each image's tiles)."""
    return TrainingParts(
        load_llava_onevision,
        llava_onevision_layers,
        "multi_modal_projector",
        OnevisionDataset,
        collate_onevision,
        save_text_and_image_parts,
        packed_collate=collate_packed_onevision,
    )


def llava_onevision_target(model_dir: str, preprocessor: OnevisionPreprocessor, text_tokens: int = 8) -> ProfileTarget:
    """The layer lists, input factories and shape policy of the LLaVA-OneVision model in ``model_dir``
    (the encoder sweep's tiles are base tiles, as the policy counts the encoder by tiles)."""
    model = load_llava_onevision(model_dir)
    encoder, projector, llm = llava_onevision_layers(model)
    return ProfileTarget(
        encoder_layers=encoder,
        projector=projector,
        llm_layers=llm,
        encoder_inputs=OnevisionEncoderInputs(model.config, text_tokens, model.dtype),
        llm_inputs=ContractLLMInputs(int(model.config.text_config.hidden_size), model.dtype),
        output_loss=summed_cross_entropy,
        policy=preprocessor.policy(),
    )


def llava_onevision_check() -> CheckParts:
    """LLaVA-OneVision's check-model parts: AnyRes images (random sizes and aspect ratios), several
    images in a row (one tile each), text-only rows, and a video row."""

    def microbatches(path: Path, config: Any) -> MicrobatchBuilder:
        return OnevisionInputs.from_dir(path, config).microbatch

    return CheckParts(
        load_llava_onevision,
        llava_onevision_layers,
        microbatches,
        IMAGE_MARK,
        lambda model, inputs: onevision_hf_kwargs(inputs),
        tower_hidden_states,
        video_image_text_batches(IMAGE_MARK, VIDEO_MARK),
    )


FAMILY = ModelFamily(
    name="LLaVA-OneVision",
    model_types=(MODEL_TYPE,),
    files=(
        "models/hf/llava_onevision.py",
        "models/hf/llava_onevision_data.py",
        "models/hf/llava_onevision_family.py",
        "models/hf/llava_onevision_shapes.py",
        "models/hf/llava_onevision_synthetic.py",
        "testing/llava_onevision_tiny.py",
    ),
    preprocessor=llava_onevision_preprocessor,
    training=llava_onevision_training,
    profile_target=llava_onevision_target,
    check_parts=llava_onevision_check,
    tensor_parallel=False,  # AutoTP of its language model is untested
)

__all__ = [
    "FAMILY",
    "llava_onevision_check",
    "llava_onevision_preprocessor",
    "llava_onevision_target",
    "llava_onevision_training",
]
