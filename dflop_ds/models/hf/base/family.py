"""One registry record per family from its pieces, each named once (:func:`hf_family`): the
training parts, profiling target and ``check-model`` parts every family registers all share the
model's loader and layer lists, so a family module names those once and the record is built here."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from dflop_ds.models.hf.base.folder import save_text_and_image_parts
from dflop_ds.models.hf.check_parts import CheckParts, MicrobatchBuilder, no_batches
from dflop_ds.models.hf.profile import family_profile_target
from dflop_ds.models.hf.registry import ModelFamily
from dflop_ds.models.hf.trainer_parts import TrainerParts
from dflop_ds.models.hf.training import TrainingParts
from dflop_ds.profile.inputs import ContractLLMInputs


def hf_family(
    name: str,
    model_types: tuple[str, ...],
    files: tuple[str, ...],
    *,
    load: Callable[[Any], Any],
    layers: Callable[[Any], tuple[list, Any, list]],
    projector_name: str,
    dataset: Callable[..., Any],
    collate: Callable,
    packed_collate: Callable,
    encoder_inputs: Callable[[Any, int, Any], Any],
    microbatches: Callable[[Path, Any], MicrobatchBuilder],
    image_mark: str,
    hf_kwargs: Callable[[Any, tuple], dict],
    vision_states: Callable[[Any, tuple], Any],
    preprocessor: Callable[..., Any],
    trainer: Callable[[], TrainerParts],
    llm_inputs: Callable[[int, Any], Any] = ContractLLMInputs,
    extra_batches: Callable[[int, Any], list[tuple[str, list]]] = no_batches,
    save_processor: Callable[[Any, str], None] = save_text_and_image_parts,
    tile_pixels: Callable[[Any], Any] | None = None,
    tensor_parallel: bool = False,
    processor_policy: Callable[[Any], Any] | None = None,
) -> ModelFamily:
    """The :class:`~dflop_ds.models.hf.registry.ModelFamily` of ``name`` (``model_types``, its own
    ``files``): its :class:`~dflop_ds.models.hf.training.TrainingParts` (``load``, ``layers``,
    ``projector_name``, the dataset and collates, ``save_processor``, ``tile_pixels``), its profiling
    target (:func:`~dflop_ds.models.hf.profile.family_profile_target` with the input factories), its
    :class:`~dflop_ds.models.hf.check_parts.CheckParts` (``microbatches``, ``image_mark``,
    ``hf_kwargs``, ``vision_states``, ``extra_batches``) and the rest as the record takes them."""
    training = partial(
        TrainingParts,
        load,
        layers,
        projector_name,
        dataset,
        collate,
        save_processor,
        tile_pixels=tile_pixels,
        packed_collate=packed_collate,
    )
    target = partial(
        family_profile_target, load=load, layers=layers, encoder_inputs=encoder_inputs, llm_inputs=llm_inputs
    )
    check = partial(CheckParts, load, layers, microbatches, image_mark, hf_kwargs, vision_states, extra_batches)
    return ModelFamily(
        name,
        model_types,
        files,
        preprocessor,
        training,
        target,
        check,
        trainer,
        tensor_parallel,
        processor_policy,
    )


__all__ = ["hf_family"]
