"""The InternVL family (``InternVLForConditionalGeneration``: dynamic tiles with a thumbnail, pixel
shuffle, multi-image and video samples) as a registered
:class:`~dflop_ds.models.hf.registry.ModelFamily`: its adapter (:mod:`~dflop_ds.models.hf.internvl`),
tiling rule (:mod:`~dflop_ds.models.hf.internvl_shapes`), data pipeline
(:mod:`~dflop_ds.models.hf.internvl_data`) and synthetic microbatches
(:mod:`~dflop_ds.models.hf.internvl_synthetic`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflop_ds.data.video import DEFAULT_VIDEO_MAX_FRAMES
from dflop_ds.models.hf.check import tower_hidden_states, video_image_text_batches
from dflop_ds.models.hf.check_parts import CheckParts, MicrobatchBuilder
from dflop_ds.models.hf.folder import save_text_and_image_parts
from dflop_ds.models.hf.internvl import MODEL_TYPE, internvl_layers, load_internvl, side
from dflop_ds.models.hf.internvl_data import InternVLDataset, InternVLPreprocessor
from dflop_ds.models.hf.internvl_synthetic import IMAGE_MARK, VIDEO_MARK, InternVLInputs
from dflop_ds.models.hf.llava import LlavaEncoderInputs
from dflop_ds.models.hf.llava_data import collate_llava, collate_packed_llava
from dflop_ds.models.hf.llava_synthetic import hf_model_kwargs
from dflop_ds.models.hf.registry import ModelFamily
from dflop_ds.models.hf.training import TrainingParts
from dflop_ds.profile.inputs import ContractLLMInputs
from dflop_ds.profile.target import ProfileTarget, summed_cross_entropy


def internvl_preprocessor(
    model_dir: str,
    *,
    max_length: int | None = None,
    truncation: str = "error",
    video_max_frames: int = DEFAULT_VIDEO_MAX_FRAMES,
    **video: Any,
) -> InternVLPreprocessor:
    """The :class:`~dflop_ds.models.hf.internvl_data.InternVLPreprocessor` of ``model_dir`` (frames are
    sampled uniformly, so the frame rate in ``video`` does not apply)."""
    return InternVLPreprocessor.from_pretrained(
        model_dir, max_length=max_length, truncation=truncation, video_max_frames=video_max_frames
    )


def internvl_training() -> TrainingParts:
    """InternVL's training pieces, on LLaVA's contract and collates: under LoRA the projector trains in
    full; a colocated encoder is not offered (untested for this family)."""
    return TrainingParts(
        load_internvl,
        internvl_layers,
        "multi_modal_projector",
        InternVLDataset,
        collate_llava,
        save_text_and_image_parts,
        packed_collate=collate_packed_llava,
    )


class InternVLEncoderInputs(LlavaEncoderInputs):
    """Profiler input factory of the first encoder layer: LLaVA's, ``image_seq_length`` tokens a tile."""

    def __init__(self, config: Any, text_tokens: int = 8, dtype: Any = None) -> None:
        vision = config.vision_config
        self.image_size = side(vision.image_size)
        self.channels = int(vision.num_channels)
        self.image_token_id, self.vocab_size = int(config.image_token_id), int(config.text_config.vocab_size)
        self.tokens_per_image = int(config.image_seq_length)
        self.text_tokens, self.dtype = int(text_tokens), dtype


def internvl_target(model_dir: str, preprocessor: InternVLPreprocessor, text_tokens: int = 8) -> ProfileTarget:
    """The layer lists, input factories and shape policy of the InternVL model in ``model_dir``."""
    model = load_internvl(model_dir)
    encoder, projector, llm = internvl_layers(model)
    return ProfileTarget(
        encoder_layers=encoder,
        projector=projector,
        llm_layers=llm,
        encoder_inputs=InternVLEncoderInputs(model.config, text_tokens, model.dtype),
        llm_inputs=ContractLLMInputs(int(model.config.text_config.hidden_size), model.dtype),
        output_loss=summed_cross_entropy,
        policy=preprocessor.policy(),
    )


def internvl_check() -> CheckParts:
    """InternVL's check-model parts: tiled images of random sizes, several images in a row, text-only
    rows and a video row."""

    def microbatches(path: Path, config: Any) -> MicrobatchBuilder:
        return InternVLInputs.from_dir(path, config).microbatch

    return CheckParts(
        load_internvl,
        internvl_layers,
        microbatches,
        IMAGE_MARK,
        lambda model, inputs: hf_model_kwargs(inputs),
        tower_hidden_states,
        video_image_text_batches(IMAGE_MARK, VIDEO_MARK),
    )


FAMILY = ModelFamily(
    name="InternVL",
    model_types=(MODEL_TYPE,),
    files=(
        "models/hf/internvl.py",
        "models/hf/internvl_data.py",
        "models/hf/internvl_family.py",
        "models/hf/internvl_shapes.py",
        "models/hf/internvl_synthetic.py",
        "testing/internvl_tiny.py",
    ),
    preprocessor=internvl_preprocessor,
    training=internvl_training,
    profile_target=internvl_target,
    check_parts=internvl_check,
    tensor_parallel=False,  # AutoTP of its language model is untested
)

__all__ = ["FAMILY", "internvl_check", "internvl_preprocessor", "internvl_target", "internvl_training"]
