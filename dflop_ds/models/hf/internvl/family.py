"""The InternVL family (``InternVLForConditionalGeneration``: dynamic tiles with a thumbnail, pixel
shuffle, multi-image and video samples) as a registered
:class:`~dflop_ds.models.hf.registry.ModelFamily`: its adapter (:mod:`~dflop_ds.models.hf.internvl.model`),
tiling rule (:mod:`~dflop_ds.models.hf.internvl.shapes`), data pipeline
(:mod:`~dflop_ds.models.hf.internvl.data`) and synthetic microbatches
(:mod:`~dflop_ds.models.hf.internvl.synthetic`)."""

from __future__ import annotations

from typing import Any

from dflop_ds.models.hf.base.collate import collate_packed, collate_padded
from dflop_ds.models.hf.base.family import hf_family
from dflop_ds.models.hf.base.synthetic import hf_model_kwargs
from dflop_ds.models.hf.base.tiled_data import tiled_preprocessor_loader
from dflop_ds.models.hf.base.vision import TileEncoderInputs
from dflop_ds.models.hf.check import tower_hidden_states, video_image_text_batches
from dflop_ds.models.hf.internvl.data import InternVLDataset, InternVLPreprocessor
from dflop_ds.models.hf.internvl.model import MODEL_TYPE, internvl_layers, load_internvl, side
from dflop_ds.models.hf.internvl.synthetic import IMAGE_MARK, VIDEO_MARK, InternVLInputs
from dflop_ds.models.hf.trainer_parts import BlankImage, TrainerParts, text_pad_token

#: The :class:`~dflop_ds.models.hf.internvl.data.InternVLPreprocessor` of a model directory.
internvl_preprocessor = tiled_preprocessor_loader(InternVLPreprocessor)


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


#: On LLaVA's contract and collates: under LoRA the projector trains in full; a colocated encoder is
#: not offered (untested for this family). Check-model: tiled images of random sizes, several images
#: in a row, text-only rows and a video row.
FAMILY = hf_family(
    "InternVL",
    (MODEL_TYPE,),
    ("models/hf/internvl/", "testing/internvl_tiny.py"),
    load=load_internvl,
    layers=internvl_layers,
    projector_name="multi_modal_projector",
    dataset=InternVLDataset,
    collate=collate_padded,
    packed_collate=collate_packed,
    encoder_inputs=InternVLEncoderInputs,
    microbatches=lambda path, config: InternVLInputs.from_dir(path, config).microbatch,
    image_mark=IMAGE_MARK,
    hf_kwargs=lambda model, inputs: hf_model_kwargs(inputs),
    vision_states=tower_hidden_states,
    extra_batches=video_image_text_batches(IMAGE_MARK, VIDEO_MARK),
    preprocessor=internvl_preprocessor,
    trainer=internvl_trainer,
    tensor_parallel=False,  # AutoTP of its language model is untested
)

__all__ = ["FAMILY", "internvl_preprocessor"]
