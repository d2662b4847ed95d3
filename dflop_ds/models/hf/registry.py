"""The HuggingFace model families dflop-ds trains, keyed by ``config.model_type``.

Each family is one :class:`ModelFamily` object in a module of its own (:data:`FAMILY_MODULES`),
which provides everything the package asks of a family: its data preprocessor (tokenization
template and shape policy), its training pieces (loading, layer lists, dataset and collates),
its profiling target, its ``check-model`` parts, its Trainer-path parts (image-free guard,
padding-free collation) and its capabilities. Training, profiling, the
data commands and ``check-model`` all find a directory's family here (:func:`family_of`), and a
``model_type`` no family registers is refused naming the registered ones. Adding a family is a
new family folder plus one line in :data:`FAMILY_MODULES`.

The family modules are imported on the first lookup, so ``import dflop_ds`` stays light.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflop_ds.data.errors import PathArg

if TYPE_CHECKING:
    from dflop_ds.models.hf.check_parts import CheckParts
    from dflop_ds.models.hf.trainer_parts import TrainerParts
    from dflop_ds.models.hf.training import TrainingParts
    from dflop_ds.profile.target import ProfileTarget
    from dflop_ds.shapes import ShapePolicy

#: The modules that define a family, each as a module-level ``FAMILY``.
FAMILY_MODULES = (
    "dflop_ds.models.hf.llava.family",
    "dflop_ds.models.hf.qwen2_vl.family",
    "dflop_ds.models.hf.llava_onevision.family",
    "dflop_ds.models.hf.internvl.family",
    "dflop_ds.models.hf.qwen3_vl.family",
)


@dataclass(frozen=True)
class ModelFamily:
    """One HuggingFace model family, all the package asks of it.

    Attributes:
        name: the family's name in messages (e.g. ``"LLaVA"``).
        model_types: the ``config.model_type`` values it runs.
        files: its own modules, relative to the package root (``models/hf/llava/model.py``, its tiny
            test builders in ``testing/``): the only modules that may name its ``model_types``.
        preprocessor: ``(model_dir, *, max_length, truncation, video_fps, video_max_frames)`` ->
            the data preprocessor (tokenization template, media processing, ``policy()``).
        training: ``() ->`` its :class:`~dflop_ds.models.hf.training.TrainingParts` (whose
            ``tile_pixels`` says whether its encoder tiles can go to a colocated encoder).
        profile_target: ``(model_dir, preprocessor, text_tokens) ->`` its profiling target.
        check_parts: ``() ->`` its :class:`~dflop_ds.models.hf.check.CheckParts`.
        trainer: ``() ->`` its :class:`~dflop_ds.models.hf.trainer_parts.TrainerParts` (the
            image-free guard's blank image and the padding-free collation of ``DFLOPTrainer``).
        tensor_parallel: whether DeepSpeed AutoTP may shard its language model (where its
            config declares a tensor-parallel plan).
        processor_policy: ``(processor) ->`` the shape policy of a loaded HF processor of the family
            (the Trainer path's :func:`~dflop_ds.hf_trainer.hf_dataset_shapes`); None: not offered yet.
    """

    name: str
    model_types: tuple[str, ...]
    files: tuple[str, ...]
    preprocessor: Callable[..., Any]
    training: Callable[[], TrainingParts]
    profile_target: Callable[[str, Any, int], ProfileTarget]
    check_parts: Callable[[], CheckParts]
    trainer: Callable[[], TrainerParts]
    tensor_parallel: bool
    processor_policy: Callable[[Any], ShapePolicy] | None = None


@cache
def registered_families() -> tuple[ModelFamily, ...]:
    """Every registered family, in :data:`FAMILY_MODULES` order (imported on first call)."""
    families = tuple(importlib.import_module(name).FAMILY for name in FAMILY_MODULES)
    seen: dict[str, str] = {}
    for family in families:
        for kind in family.model_types:
            if kind in seen:
                raise ValueError(f"model type {kind!r} is registered by both {seen[kind]} and {family.name}")
            seen[kind] = family.name
    return families


def registered_model_types() -> list[str]:
    """The ``model_type`` values some family runs, in registration order."""
    return [kind for family in registered_families() for kind in family.model_types]


def family_for(kind: str | None, where: str = "model") -> ModelFamily:
    """The family that runs ``config.model_type == kind``; ``ValueError`` naming ``where``, the
    type and every registered type when none does."""
    for family in registered_families():
        if kind in family.model_types:
            return family
    raise ValueError(
        f"{where}: model type {kind!r} is not supported "
        f"(supported: {', '.join(repr(name) for name in registered_model_types())})"
    )


def trainer_parts_of(config: Any) -> TrainerParts | None:
    """The Trainer-path parts of the family of a loaded model's ``config.model_type``; None when no
    family registers it (a model the Trainer then runs without the family's guard and collation)."""
    kind = getattr(config, "model_type", None)
    if kind not in registered_model_types():
        return None
    return family_for(kind).trainer()


def processor_family(processor: Any) -> ModelFamily:
    """The family of a loaded HF processor, by the transformers model folder its class comes from
    (``transformers.models.<model_type>.processing_...``); ``ValueError`` naming the class when it
    comes from none or from one no family registers."""
    parts = type(processor).__module__.split(".")
    kind = parts[2] if len(parts) > 3 and parts[:2] == ["transformers", "models"] else None
    if kind is None:
        raise ValueError(
            f"processor {type(processor).__name__} (module {type(processor).__module__}) is not a transformers"
            " model's processor, so its model family is unknown"
        )
    return family_for(kind, f"processor {type(processor).__name__}")


def model_type(model_dir: PathArg) -> str | None:
    """``model_type`` of a ``save_pretrained`` directory's ``config.json`` (None when it has none):
    what picks the model family."""
    path = Path(model_dir) / "config.json"
    return json.loads(path.read_text()).get("model_type") if path.is_file() else None


def family_of(model_dir: PathArg) -> ModelFamily:
    """The family of a ``save_pretrained`` directory, by its ``config.json``'s ``model_type``
    (``FileNotFoundError`` naming the directory when it has no ``config.json``)."""
    if not (Path(model_dir) / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir}: no config.json (expected a save_pretrained model directory)")
    from dflop_ds.jsonio import read_json_object

    read_json_object(Path(model_dir) / "config.json")  # a corrupt one is named, with its line and column
    return family_for(model_type(model_dir), str(model_dir))


__all__ = [
    "FAMILY_MODULES",
    "ModelFamily",
    "family_for",
    "family_of",
    "model_type",
    "processor_family",
    "registered_families",
    "registered_model_types",
    "trainer_parts_of",
]
