"""The LLaVA-OneVision family (``LlavaOnevisionForConditionalGeneration``: AnyRes tiles, multi-image
and video samples) as a registered :class:`~dflop_ds.models.hf.registry.ModelFamily`: its adapter
(:mod:`~dflop_ds.models.hf.llava_onevision.model`), counting rule (:mod:`~dflop_ds.models.hf.llava_onevision.shapes`),
data pipeline (:mod:`~dflop_ds.models.hf.llava_onevision.data`) and synthetic microbatches
(:mod:`~dflop_ds.models.hf.llava_onevision.synthetic`)."""

from __future__ import annotations

from typing import Any

from dflop_ds.models.hf.base.family import hf_family
from dflop_ds.models.hf.base.tiled_data import tiled_preprocessor_loader
from dflop_ds.models.hf.check import tower_hidden_states, video_image_text_batches
from dflop_ds.models.hf.llava_onevision.data import (
    OnevisionDataset,
    OnevisionPreprocessor,
    collate_onevision,
    collate_packed_onevision,
)
from dflop_ds.models.hf.llava_onevision.model import (
    MODEL_TYPE,
    OnevisionEncoderInputs,
    llava_onevision_layers,
    load_llava_onevision,
)
from dflop_ds.models.hf.llava_onevision.synthetic import (
    IMAGE_MARK,
    VIDEO_MARK,
    OnevisionInputs,
    config_rule,
    onevision_hf_kwargs,
)
from dflop_ds.models.hf.trainer_parts import BlankImage, BlankVideo, TrainerParts, text_pad_token

#: The :class:`~dflop_ds.models.hf.llava_onevision.data.OnevisionPreprocessor` of a model directory.
llava_onevision_preprocessor = tiled_preprocessor_loader(OnevisionPreprocessor)


def llava_onevision_blank_image(config: Any) -> BlankImage:
    """One blank tile-sized image as HF's model takes it: its AnyRes tiles ``[1, tiles, C, T, T]``,
    its ``image_sizes`` row and the tokens it becomes (the counting rule of the config); and a
    blank one-frame video ``[1, 1, C, T, T]`` (HF's model runs its tower apart for videos)."""
    rule = config_rule(config)
    tile = rule.tile_size
    tiles, tokens = rule.image(tile, tile)
    image_token_id = int(config.image_token_id)
    channels = int(getattr(config.vision_config, "num_channels", 3))
    _, video_tokens = rule.video(1)
    video_token_id = int(config.video_token_id)
    video = BlankVideo((1, 1, channels, tile, tile), video_token_id, video_tokens)
    pad = text_pad_token(config, image_token_id, video_token_id)
    return BlankImage(
        (1, tiles, channels, tile, tile), image_token_id, tokens, pad, image_sizes=(tile, tile), video=video
    )


def llava_onevision_trainer() -> TrainerParts:
    """LLaVA-OneVision on the Trainer path: its blank image; padding-free batches concatenate the
    samples' images (tiles padded to the largest image's count: HF takes each image's by its size),
    sizes, videos and images-per-sample counts."""
    return TrainerParts(
        llava_onevision_blank_image,
        media_keys=("pixel_values", "image_sizes", "pixel_values_videos", "batch_num_images"),
        padded_keys=("pixel_values",),
    )


#: Under LoRA the projector trains in full, as LLaVA's does; its tiles cannot be dispatched to a
#: colocated encoder yet (the projector needs each image's tiles). The encoder sweep's tiles are base
#: tiles, as the policy counts the encoder by tiles. Check-model: AnyRes images (random sizes and
#: aspect ratios), several images in a row (one tile each), text-only rows, and a video row.
FAMILY = hf_family(
    "LLaVA-OneVision",
    (MODEL_TYPE,),
    ("models/hf/llava_onevision/", "testing/llava_onevision_tiny.py"),
    load=load_llava_onevision,
    layers=llava_onevision_layers,
    projector_name="multi_modal_projector",
    dataset=OnevisionDataset,
    collate=collate_onevision,
    packed_collate=collate_packed_onevision,
    encoder_inputs=OnevisionEncoderInputs,
    microbatches=lambda path, config: OnevisionInputs.from_dir(path, config).microbatch,
    image_mark=IMAGE_MARK,
    hf_kwargs=lambda model, inputs: onevision_hf_kwargs(inputs),
    vision_states=tower_hidden_states,
    extra_batches=video_image_text_batches(IMAGE_MARK, VIDEO_MARK),
    preprocessor=llava_onevision_preprocessor,
    trainer=llava_onevision_trainer,
    tensor_parallel=False,  # AutoTP of its language model is untested
)

__all__ = ["FAMILY", "llava_onevision_preprocessor"]
