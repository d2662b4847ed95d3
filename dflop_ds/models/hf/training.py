"""What the training loop needs of a HuggingFace model family (:class:`TrainingParts`, one
field of its :class:`~dflop_ds.models.hf.registry.ModelFamily`), and the :class:`ModelSource`
built from it (:func:`training_source`); each family's file only names its own pieces.

The layer lists share their modules with the HF model, so training them trains the HF model,
and :meth:`ModelSource.save_pretrained` writes it back in HF's own format (after the loop has
gathered the trained weights of every stage on one rank).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflop_ds.data.formats import shape_reader
from dflop_ds.data.media import media_folder
from dflop_ds.models.hf.base.dataset import load_llava_records, supervised_targets
from dflop_ds.models.hf.lora import LoraSettings, apply_lora
from dflop_ds.models.source import ModelSource


def load_flat_state(layers: list, state: Mapping[str, torch.Tensor]) -> None:
    """Copy a gathered flat state (``"<layer index>.<name>"``) into the layer modules.

    Every layer with a state must find all of it (strict loading), so a gathered state that
    misses a layer's weights, or names one the layer lacks, raises naming the layer.
    """
    grouped: dict[int, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        head, _, rest = key.partition(".")
        if head.isdigit():
            grouped.setdefault(int(head), {})[rest] = tensor
    if grouped and max(grouped) >= len(layers):
        raise KeyError(f"gathered state names layer {max(grouped)}, but the model has {len(layers)} layers")
    for index, layer in enumerate(layers):
        values = grouped.get(index, {})
        if not values and not layer.state_dict():
            continue
        try:
            layer.load_state_dict(values, strict=True)
        except RuntimeError as error:
            raise RuntimeError(f"layer {index} ({type(layer).__name__}) of the gathered state: {error}") from error


@dataclass(frozen=True)
class TrainingParts:
    """The training pieces of one HF model family: how to load the model and cut it into
    layer lists, which module LoRA runs still train in full (the projector), the dataset class and
    the padded and packed collates of its microbatch contract, how its processor is written back, and
    a dataset item's encoder tiles for a colocated encoder (None: the family cannot dispatch them)."""

    load: Callable[[str], Any]
    layers: Callable[[Any], tuple]
    projector_name: str
    dataset: Callable[..., Any]
    collate: Callable
    save_processor: Callable[[Any, str], None]
    tile_pixels: Callable[[Any], torch.Tensor] | None = None
    packed_collate: Callable | None = None


def training_source(
    model_dir: str,
    parts: TrainingParts,
    preprocessor: Any,
    *,
    image_folder: str | None = None,
    lora: LoraSettings | None = None,
    video_folder: str | None = None,
) -> ModelSource:
    """The training-loop source of ``model_dir`` for a model family's training ``parts`` with its ``preprocessor``
    (tokenization template, image processing, shape policy); media paths are relative to
    ``image_folder`` / ``video_folder`` (default: the data file's folder)."""

    def build() -> tuple[Any, Any]:
        """A fresh copy of the model (with its LoRA adapters) and its PeftModel, if any."""
        built = parts.load(model_dir)
        if lora is None:
            return built, None
        return built, apply_lora(built, lora, keep_trainable=parts.projector_name)

    model, _ = build()
    policy = preprocessor.policy()
    encoder, projector, llm = parts.layers(model)

    read_shapes = shape_reader(policy, image_folder, video_folder)

    def make_dataset(shapes, path: str, on_bad_sample: str = "error"):
        return parts.dataset(
            list(shapes),
            load_llava_records(path),
            preprocessor,
            media_folder(path, image_folder),
            source=path,
            video_folder=media_folder(path, video_folder),
            on_bad_sample=on_bad_sample,
        )

    def save_pretrained(directory: str, state: Mapping[str, torch.Tensor]) -> None:
        # into a fresh copy: the training copy's parameters may be ZeRO-3 partitions
        fresh, peft_model = build()
        fresh_encoder, fresh_projector, fresh_llm = parts.layers(fresh)
        load_flat_state([*fresh_encoder, fresh_projector, *fresh_llm], state)
        final = peft_model.merge_and_unload() if peft_model is not None else fresh
        final.save_pretrained(directory)
        parts.save_processor(preprocessor, directory)

    return ModelSource(
        f"{model.config.model_type}:{Path(model_dir).name}",
        list(encoder),
        projector,
        list(llm),
        policy,
        read_shapes,
        make_dataset,
        parts.collate,
        supervised_targets,
        save_pretrained=save_pretrained,
        hf_model=model,
        tile_pixels=parts.tile_pixels,
        packed_collate=parts.packed_collate,
        truncated_samples=lambda: int(preprocessor.truncated_samples),
    )
