"""A HuggingFace LLaVA ``save_pretrained`` directory as a training-loop :class:`ModelSource`.

The layer lists share their modules with the HF model, so training them trains the HF model,
and :meth:`ModelSource.save_pretrained` writes it back in HF's own format (after the loop has
gathered the trained weights of every stage on one rank).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from dflop_ds.train.sources import ModelSource


def load_flat_state(layers: list, state: Mapping[str, torch.Tensor]) -> None:
    """Copy a gathered flat state (``"<layer index>.<name>"``) into the layer modules.

    Layers with no entry (e.g. a layer without parameters) are left alone; an entry for a
    parameter a layer does not have raises, naming it.
    """
    grouped: dict[int, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        head, _, rest = key.partition(".")
        if head.isdigit():
            grouped.setdefault(int(head), {})[rest] = tensor
    for index, values in grouped.items():
        if index >= len(layers):
            raise KeyError(f"gathered state names layer {index}, but the model has {len(layers)} layers")
        layers[index].load_state_dict(values, strict=False)


def is_tensor_parallel_layer(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a layer DeepSpeed AutoTP put in place of a whole one (e.g. ``LinearLayer``)."""
    return type(module).__module__.startswith("deepspeed.module_inject")


def tensor_parallel_sharded(model: torch.nn.Module) -> bool:
    """Whether DeepSpeed AutoTP replaced some of ``model``'s layers by sharded ones."""
    return any(is_tensor_parallel_layer(m) for m in model.modules())


def hf_source(
    model_dir: str,
    *,
    image_folder: Optional[str] = None,
    freeze_encoder: bool = False,
    lora: Optional[Mapping[str, Any]] = None,
    max_length: Optional[int] = None,
    truncation: str = "error",
) -> ModelSource:
    """The LLaVA model, processor and data pipeline of ``model_dir`` for the training loop.

    Args:
        model_dir: a ``save_pretrained`` directory of a ``LlavaForConditionalGeneration`` with
            its processor.
        image_folder: folder the records' image paths are relative to (default: the data
            file's folder).
        freeze_encoder: freeze the vision tower (LLaVA's second stage); applied by the engine.
        lora: LoRA settings for the language model (see :func:`dflop_ds.models.hf.lora.apply_lora`);
            None trains all weights.
        max_length, truncation: sequence-length rule of the tokenization
            (:class:`~dflop_ds.models.hf.data.LlavaPreprocessor`).
    """
    from dflop_ds.data import read_dataset
    from dflop_ds.models.hf.data import (LlavaDataset, LlavaPreprocessor, collate_llava, load_llava_records,
                                         supervised_targets)
    from dflop_ds.models.hf.llava import llava_layers, load_llava

    from dflop_ds.models.hf.lora import apply_lora

    model = load_llava(model_dir)
    peft_model = None if lora is None else apply_lora(model, lora)
    preprocessor = LlavaPreprocessor.from_pretrained(model_dir, max_length=max_length, truncation=truncation)
    policy = preprocessor.policy()
    encoder, projector, llm = llava_layers(model)

    def folder_for(path: str) -> str:
        return image_folder if image_folder is not None else str(Path(path).parent)

    def read_shapes(path: str, on_bad_sample: str):
        return read_dataset(path, policy, on_bad_sample=on_bad_sample, image_folder=folder_for(path))

    def make_dataset(shapes, path: str):
        return LlavaDataset(list(shapes), load_llava_records(path), preprocessor, folder_for(path), source=path)

    layers = [*encoder, projector, *llm]

    def save_pretrained(directory: str, state: Mapping[str, torch.Tensor]) -> None:
        target, target_layers, target_peft = model, layers, peft_model
        if tensor_parallel_sharded(model):  # AutoTP sharded the live modules: fill a whole copy
            target = load_llava(model_dir)
            target_peft = None if lora is None else apply_lora(target, lora)
            fresh_encoder, fresh_projector, fresh_llm = llava_layers(target)
            target_layers = [*fresh_encoder, fresh_projector, *fresh_llm]
        load_flat_state(target_layers, state)
        final = target_peft.merge_and_unload() if target_peft is not None else target
        final.save_pretrained(directory)
        preprocessor.processor.save_pretrained(directory)

    return ModelSource(f"llava:{Path(model_dir).name}", list(encoder), projector, list(llm), policy,
                       read_shapes, make_dataset, collate_llava, supervised_targets,
                       save_pretrained=save_pretrained, hf_model=model)
