"""A HuggingFace Qwen2-VL ``save_pretrained`` directory as a training-loop :class:`ModelSource`
(what :func:`dflop_ds.models.hf.source.hf_source` returns for ``model_type == "qwen2_vl"``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dflop_ds.models.hf.family import HFFamily, family_source
from dflop_ds.models.hf.qwen2_vl import load_qwen2_vl, qwen2_vl_layers
from dflop_ds.models.hf.qwen2_vl_data import (
    Qwen2VLDataset,
    Qwen2VLPreprocessor,
    collate_packed_qwen2_vl,
    collate_qwen2_vl,
)
from dflop_ds.models.source import ModelSource


def qwen2_vl_source(
    model_dir: str,
    preprocessor: Qwen2VLPreprocessor,
    *,
    image_folder: str | None = None,
    lora: Mapping[str, Any] | None = None,
    video_folder: str | None = None,
) -> ModelSource:
    """The Qwen2-VL model, its data pipeline (:mod:`~dflop_ds.models.hf.qwen2_vl_data`, with the
    ``preprocessor`` of :func:`~dflop_ds.models.hf.preprocessor.hf_preprocessor`) and layer lists for
    the training loop. The other arguments as for ``hf_source``; with LoRA the patch merger (the
    projector) is trained in full, as the LLaVA projector is."""

    def save_processor(preprocessor: Any, directory: str) -> None:
        preprocessor.tokenizer.save_pretrained(directory)
        preprocessor.image_processor.save_pretrained(directory)

    family = HFFamily(
        load_qwen2_vl,
        qwen2_vl_layers,
        "visual.merger",
        Qwen2VLDataset,
        collate_qwen2_vl,
        save_processor,
        packed_collate=collate_packed_qwen2_vl,
    )
    return family_source(
        model_dir, family, preprocessor, image_folder=image_folder, lora=lora, video_folder=video_folder
    )


__all__ = ["qwen2_vl_source"]
