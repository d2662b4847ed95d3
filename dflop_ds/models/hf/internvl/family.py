"""The InternVL family (``InternVLForConditionalGeneration``: dynamic tiles with a thumbnail, pixel
shuffle, multi-image and video samples) as a registered
:class:`~dflop_ds.models.hf.registry.ModelFamily`: its adapter (:mod:`~dflop_ds.models.hf.internvl.model`),
tiling rule (:mod:`~dflop_ds.models.hf.internvl.shapes`), data pipeline
(:mod:`~dflop_ds.models.hf.internvl.data`) and synthetic microbatches
(:mod:`~dflop_ds.models.hf.internvl.synthetic`)."""

from __future__ import annotations

from functools import partial
from typing import Any

from dflop_ds.models.hf.base.collate import collate_packed, collate_padded
from dflop_ds.models.hf.base.folder import save_text_and_image_parts
from dflop_ds.models.hf.base.synthetic import hf_model_kwargs
from dflop_ds.models.hf.base.tiled_family import tiled_check_parts, tiled_preprocessor_loader
from dflop_ds.models.hf.base.vision import TileEncoderInputs
from dflop_ds.models.hf.check_parts import CheckParts
from dflop_ds.models.hf.internvl.data import InternVLDataset, InternVLPreprocessor
from dflop_ds.models.hf.internvl.model import MODEL_TYPE, internvl_layers, load_internvl, side
from dflop_ds.models.hf.internvl.synthetic import IMAGE_MARK, VIDEO_MARK, InternVLInputs
from dflop_ds.models.hf.profile import family_profile_target
from dflop_ds.models.hf.registry import ModelFamily
from dflop_ds.models.hf.trainer_parts import BlankImage, TrainerParts, text_pad_token
from dflop_ds.models.hf.training import TrainingParts

#: The :class:`~dflop_ds.models.hf.internvl.data.InternVLPreprocessor` of a model directory.
internvl_preprocessor = tiled_preprocessor_loader(InternVLPreprocessor)


def internvl_training() -> TrainingParts:
    """InternVL's training pieces, on LLaVA's contract and collates: under LoRA the projector trains in
    full; a colocated encoder is not offered (untested for this family)."""
    return TrainingParts(
        load_internvl,
        internvl_layers,
        "multi_modal_projector",
        InternVLDataset,
        collate_padded,
        save_text_and_image_parts,
        packed_collate=collate_packed,
    )


class InternVLEncoderInputs(TileEncoderInputs):
    """Profiler input factory of the first encoder layer: LLaVA's, ``image_seq_length`` tokens a tile."""

    def __init__(self, config: Any, text_tokens: int = 8, dtype: Any = None) -> None:
        vision = config.vision_config
        self.image_size = side(vision.image_size)
        self.channels = int(vision.num_channels)
        self.image_token_id, self.vocab_size = int(config.image_token_id), int(config.text_config.vocab_size)
        self.tokens_per_image = int(config.image_seq_length)
        self.text_tokens, self.dtype = int(text_tokens), dtype


def internvl_blank_image(config: Any) -> BlankImage:
    """One blank tile ``[1, C, T, T]``: ``image_seq_length`` context tokens (HF's model writes a
    tile's features at its context tokens; the ``<img>``/``</img>`` marks are text)."""
    vision = config.vision_config
    tile = side(vision.image_size)
    image_token_id = int(config.image_token_id)
    pixels = (1, int(vision.num_channels), tile, tile)
    return BlankImage(pixels, image_token_id, int(config.image_seq_length), text_pad_token(config, image_token_id))


def internvl_trainer() -> TrainerParts:
    """InternVL on the Trainer path: its blank tile; padding-free batches concatenate the samples' tiles."""
    return TrainerParts(internvl_blank_image)


#: The layer lists, input factories and shape policy of the InternVL model in a directory.
internvl_target = partial(
    family_profile_target, load=load_internvl, layers=internvl_layers, encoder_inputs=InternVLEncoderInputs
)


def internvl_check() -> CheckParts:
    """InternVL's check-model parts: tiled images of random sizes, several images in a row, text-only
    rows and a video row."""
    return tiled_check_parts(
        load_internvl, internvl_layers, InternVLInputs.from_dir, hf_model_kwargs, IMAGE_MARK, VIDEO_MARK
    )


FAMILY = ModelFamily(
    name="InternVL",
    model_types=(MODEL_TYPE,),
    files=("models/hf/internvl/", "testing/internvl_tiny.py"),
    preprocessor=internvl_preprocessor,
    training=internvl_training,
    profile_target=internvl_target,
    check_parts=internvl_check,
    trainer=internvl_trainer,
    tensor_parallel=False,  # AutoTP of its language model is untested
)

__all__ = ["FAMILY", "internvl_check", "internvl_preprocessor", "internvl_target", "internvl_training"]
