"""The Qwen2-VL family (``Qwen2VLForConditionalGeneration``, ``Qwen2_5_VLForConditionalGeneration``)
as a registered :class:`~dflop_ds.models.hf.registry.ModelFamily`: its adapter
(:mod:`~dflop_ds.models.hf.qwen2_vl.model`), data pipeline (:mod:`~dflop_ds.models.hf.qwen2_vl.data`) and
synthetic microbatches (:mod:`~dflop_ds.models.hf.qwen2_vl.synthetic`)."""

from __future__ import annotations

import random
from functools import partial
from pathlib import Path
from typing import Any

from dflop_ds.data.video import DEFAULT_VIDEO_FPS, DEFAULT_VIDEO_MAX_FRAMES
from dflop_ds.models.hf.base.folder import save_text_and_image_parts
from dflop_ds.models.hf.base.patch_grid_family import patch_grid_trainer, patch_grid_vision_states
from dflop_ds.models.hf.check import random_frames, random_image
from dflop_ds.models.hf.check_parts import CheckParts, MicrobatchBuilder
from dflop_ds.models.hf.profile import family_profile_target
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
from dflop_ds.models.hf.registry import ModelFamily
from dflop_ds.models.hf.training import TrainingParts


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


def qwen2_vl_training() -> TrainingParts:
    """Qwen2-VL's training pieces: under LoRA the patch merger (the projector) trains in full, as
    LLaVA's projector does; its patches cannot be dispatched to a colocated encoder yet."""
    return TrainingParts(
        load_qwen2_vl,
        qwen2_vl_layers,
        "visual.merger",
        Qwen2VLDataset,
        collate_qwen2_vl,
        save_text_and_image_parts,
        packed_collate=collate_packed_qwen2_vl,
    )


#: The layer lists, input factories and shape policy of the Qwen2-VL model in a directory (the
#: encoder sweep's "tiles" are patches, the policy's encoder units).
qwen2_vl_target = partial(
    family_profile_target,
    load=load_qwen2_vl,
    layers=qwen2_vl_layers,
    encoder_inputs=Qwen2VLEncoderInputs,
    llm_inputs=MRopeLLMInputs,
)


def qwen2_vl_check() -> CheckParts:
    """Qwen2-VL's check-model parts, with a video microbatch (Qwen2-VL only: Qwen2.5-VL's videos
    are not supported yet)."""

    def microbatches(path: Path, config: Any) -> MicrobatchBuilder:
        return Qwen2VLInputs.from_dir(path, config).microbatch

    def vision_states(model: Any, inputs: tuple) -> Any:
        pixel_values, _, _, image_grid, video_grid = inputs
        return patch_grid_vision_states(model, pixel_values, tower_grid(image_grid, video_grid))

    def video_batches(seed: int, config: Any) -> list[tuple[str, list]]:
        if config.model_type != MODEL_TYPE:
            return []
        rng = random.Random(seed + 1)
        return [
            (
                "video + image row + text-only row",
                [
                    (f"USER: {VIDEO_MARK} what happens? ASSISTANT:", "a car drives", [], random_frames(rng, 4)),
                    (f"USER: {IMAGE_MARK} and this? ASSISTANT:", "a tree", [random_image(rng)]),
                    ("USER: hello ASSISTANT:", "hi there", []),
                ],
            )
        ]

    return CheckParts(
        load_qwen2_vl,
        qwen2_vl_layers,
        microbatches,
        IMAGE_MARK,
        lambda model, inputs: qwen2_vl_hf_kwargs(inputs, model.config),
        vision_states,
        video_batches,
    )


FAMILY = ModelFamily(
    name="Qwen2-VL",
    model_types=tuple(MODEL_CLASSES),
    files=("models/hf/qwen2_vl/", "testing/qwen2_vl_tiny.py"),
    preprocessor=qwen2_vl_preprocessor,
    training=qwen2_vl_training,
    profile_target=qwen2_vl_target,
    check_parts=qwen2_vl_check,
    trainer=patch_grid_trainer,
    tensor_parallel=False,  # AutoTP with M-RoPE decoder layers is untested
)

__all__ = ["FAMILY", "qwen2_vl_check", "qwen2_vl_preprocessor", "qwen2_vl_target", "qwen2_vl_training"]
