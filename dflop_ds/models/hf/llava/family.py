"""The LLaVA family (``LlavaForConditionalGeneration``, one tile per image) as a registered
:class:`~dflop_ds.models.hf.registry.ModelFamily`: its adapter (:mod:`~dflop_ds.models.hf.llava.model`),
data pipeline (:mod:`~dflop_ds.models.hf.base.template`), synthetic microbatches
(:mod:`~dflop_ds.models.hf.base.synthetic`) and processor (:mod:`~dflop_ds.models.hf.llava.processor`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dflop_ds.models.hf.base.collate import collate_packed, collate_padded
from dflop_ds.models.hf.base.dataset import MediaDataset
from dflop_ds.models.hf.base.synthetic import contract_microbatch, hf_model_kwargs
from dflop_ds.models.hf.check_parts import CheckParts, MicrobatchBuilder
from dflop_ds.models.hf.llava.data import LlavaPreprocessor
from dflop_ds.models.hf.llava.model import llava_input_factories, llava_layers, load_llava
from dflop_ds.models.hf.llava.processor import image_features_per_image, load_processor
from dflop_ds.models.hf.registry import ModelFamily
from dflop_ds.models.hf.trainer_parts import BlankImage, TrainerParts, text_pad_token
from dflop_ds.models.hf.training import TrainingParts
from dflop_ds.profile.target import ProfileTarget, summed_cross_entropy


def llava_preprocessor(model_dir: str, *, max_length: int | None = None, truncation: str = "error", **video: Any):
    """The :class:`~dflop_ds.models.hf.base.template.LlavaPreprocessor` of ``model_dir`` (LLaVA takes
    no videos, so the video rule in ``video`` does not apply)."""
    return LlavaPreprocessor.from_pretrained(model_dir, max_length=max_length, truncation=truncation)


def llava_training() -> TrainingParts:
    """LLaVA's training pieces: the projector trains in full under LoRA; one tile per image."""
    return TrainingParts(
        load_llava,
        llava_layers,
        "multi_modal_projector",
        MediaDataset,
        collate_padded,
        lambda pre, directory: pre.processor.save_pretrained(directory),
        tile_pixels=lambda item: item.pixel_values,  # one tile per image
        packed_collate=collate_packed,
    )


def llava_target(model_dir: str, preprocessor: LlavaPreprocessor, text_tokens: int = 8) -> ProfileTarget:
    """The layer lists, contract input factories and shape policy of the LLaVA model in ``model_dir``."""
    model = load_llava(model_dir)
    encoder, projector, llm = llava_layers(model)
    encoder_inputs, llm_inputs = llava_input_factories(model, text_tokens)
    return ProfileTarget(
        encoder_layers=encoder,
        projector=projector,
        llm_layers=llm,
        encoder_inputs=encoder_inputs,
        llm_inputs=llm_inputs,
        output_loss=summed_cross_entropy,
        policy=preprocessor.policy(),
    )


def llava_check() -> CheckParts:
    """LLaVA's check-model parts: microbatches through its processor, the CLIP/SigLIP tower's states."""

    def microbatches(path: Path, config: Any) -> MicrobatchBuilder:
        processor = load_processor(path, config)

        def build(samples: Sequence[Any], *, packed: bool = False) -> tuple:
            return contract_microbatch(processor, samples, packed=packed)

        return build

    def vision_states(model: Any, inputs: tuple) -> Any:
        pixel_values = inputs[0]
        if not pixel_values.shape[0]:
            return None
        return model.model.vision_tower(pixel_values, output_hidden_states=True).hidden_states

    return CheckParts(
        load_llava, llava_layers, microbatches, "<image>", lambda model, inputs: hf_model_kwargs(inputs), vision_states
    )


def llava_blank_image(config: Any) -> BlankImage | None:
    """One blank image ``[1, C, S, S]`` and the features it becomes (patches, CLIP's CLS unless the
    "default" strategy drops it); None for several feature layers (not run by this package)."""
    if not isinstance(config.vision_feature_layer, int):
        return None
    image_token_id = int(config.image_token_id)
    vision = config.vision_config
    pixels = (1, int(vision.num_channels), int(vision.image_size), int(vision.image_size))
    return BlankImage(pixels, image_token_id, image_features_per_image(config), text_pad_token(config, image_token_id))


def llava_trainer() -> TrainerParts:
    """LLaVA on the Trainer path: its blank image; padding-free batches concatenate the samples' images."""
    return TrainerParts(llava_blank_image)


FAMILY = ModelFamily(
    name="LLaVA",
    model_types=("llava",),
    files=("models/hf/llava/", "testing/hf_tiny.py"),
    preprocessor=llava_preprocessor,
    training=llava_training,
    profile_target=llava_target,
    check_parts=llava_check,
    trainer=llava_trainer,
    tensor_parallel=True,
    processor_policy=lambda processor: LlavaPreprocessor(processor).policy(),
)

__all__ = ["FAMILY", "llava_check", "llava_preprocessor", "llava_target", "llava_training"]
