"""A HuggingFace Qwen2-VL ``save_pretrained`` directory as a training-loop :class:`ModelSource`
(what :func:`dflop_ds.models.hf.source.hf_source` returns for ``model_type == "qwen2_vl"``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from dflop_ds.train.sources import ModelSource


def qwen2_vl_source(model_dir: str, *, image_folder: Optional[str] = None,
                    lora: Optional[Mapping[str, Any]] = None) -> ModelSource:
    """The Qwen2-VL model, its data pipeline (:mod:`~dflop_ds.models.hf.qwen2_vl_data`) and layer
    lists for the training loop. ``image_folder`` and ``lora`` as for ``hf_source``; with LoRA the
    patch merger (the projector) is trained in full, as the LLaVA projector is."""
    from dflop_ds.data import read_dataset
    from dflop_ds.models.hf.data import load_llava_records, supervised_targets
    from dflop_ds.models.hf.qwen2_vl import load_qwen2_vl, qwen2_vl_layers
    from dflop_ds.models.hf.qwen2_vl_data import Qwen2VLDataset, Qwen2VLPreprocessor, collate_qwen2_vl
    from dflop_ds.models.hf.source import load_flat_state

    model = load_qwen2_vl(model_dir)
    peft_model = None
    if lora is not None:
        from dflop_ds.models.hf.lora import apply_lora

        peft_model = apply_lora(model, lora)
        for parameter in model.model.visual.merger.parameters():
            parameter.requires_grad_(True)
    preprocessor = Qwen2VLPreprocessor.from_pretrained(model_dir)
    policy = preprocessor.policy()
    encoder, projector, llm = qwen2_vl_layers(model)
    layers = [*encoder, projector, *llm]

    def folder_for(path: str) -> str:
        return image_folder if image_folder is not None else str(Path(path).parent)

    def read_shapes(path: str, on_bad_sample: str):
        return read_dataset(path, policy, on_bad_sample=on_bad_sample, image_folder=folder_for(path))

    def make_dataset(shapes, path: str):
        return Qwen2VLDataset(list(shapes), load_llava_records(path), preprocessor, folder_for(path), source=path)

    def save_pretrained(directory: str, state: Mapping[str, torch.Tensor]) -> None:
        load_flat_state(layers, state)
        final = peft_model.merge_and_unload() if peft_model is not None else model
        final.save_pretrained(directory)
        preprocessor.tokenizer.save_pretrained(directory)
        preprocessor.image_processor.save_pretrained(directory)

    return ModelSource(f"{model.config.model_type}:{Path(model_dir).name}", list(encoder), projector, list(llm),
                       policy, read_shapes, make_dataset, collate_qwen2_vl, supervised_targets,
                       save_pretrained=save_pretrained, hf_model=model)


__all__ = ["qwen2_vl_source"]
