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
from dflop_ds.models.hf.base.family import hf_family
from dflop_ds.models.hf.base.synthetic import contract_microbatch, hf_model_kwargs
from dflop_ds.models.hf.base.vision import TileEncoderInputs
from dflop_ds.models.hf.check import tower_hidden_states
from dflop_ds.models.hf.check_parts import MicrobatchBuilder
from dflop_ds.models.hf.llava.data import LlavaPreprocessor
from dflop_ds.models.hf.llava.model import llava_layers, load_llava
from dflop_ds.models.hf.llava.processor import image_features_per_image, load_processor
from dflop_ds.models.hf.trainer_parts import BlankImage, TrainerParts, text_pad_token


def llava_preprocessor(model_dir: str, *, max_length: int | None = None, truncation: str = "error", **video: Any):
    """The :class:`~dflop_ds.models.hf.base.template.LlavaPreprocessor` of ``model_dir`` (LLaVA takes
    no videos, so the video rule in ``video`` does not apply)."""
    return LlavaPreprocessor.from_pretrained(model_dir, max_length=max_length, truncation=truncation)


def llava_microbatches(path: Path, config: Any) -> MicrobatchBuilder:
    """check-model's microbatches of the directory's LLaVA processor."""
    processor = load_processor(path, config)

    def build(samples: Sequence[Any], *, packed: bool = False) -> tuple:
        return contract_microbatch(processor, samples, packed=packed)

    return build


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


#: The projector trains in full under LoRA; one tile per image (so a colocated encoder takes each
#: item's pixels as its tiles). Check-model: microbatches through its processor, the CLIP/SigLIP
#: tower's states.
FAMILY = hf_family(
    "LLaVA",
    ("llava",),
    ("models/hf/llava/", "testing/hf_tiny.py"),
    load=load_llava,
    layers=llava_layers,
    projector_name="multi_modal_projector",
    dataset=MediaDataset,
    collate=collate_padded,
    packed_collate=collate_packed,
    save_processor=lambda pre, directory: pre.processor.save_pretrained(directory),
    tile_pixels=lambda item: item.pixel_values,
    encoder_inputs=TileEncoderInputs,
    microbatches=llava_microbatches,
    image_mark="<image>",
    hf_kwargs=lambda model, inputs: hf_model_kwargs(inputs),
    vision_states=tower_hidden_states,
    preprocessor=llava_preprocessor,
    trainer=llava_trainer,
    tensor_parallel=True,
    processor_policy=lambda processor: LlavaPreprocessor(processor).policy(),
)

__all__ = ["FAMILY", "llava_preprocessor"]
