"""What a Trainer checkpoint must hold for a DFLOPTrainer to resume it, and its weights mapped back.

A resumed DFLOPTrainer lands on the next untrained microbatch by the Trainer's own epoch and step
count, which is exact only for the schedule that wrote the checkpoint. The sampler state
(:data:`SAMPLER_STATE`) names that schedule: it is written, atomically, into the checkpoint
folder before the Trainer's ``trainer_state.json``, so a checkpoint the Trainer can resume always
has it; a checkpoint without it (a plain ``Trainer``'s, or one cut off before it) is refused
naming the file, as is one of another dataset, sample order, shape policy, seed or batch size.

``transformers`` 5 saves some families' weights under their legacy names (LLaVA's
``language_model.model.*``) and its Trainer loads a checkpoint without DeepSpeed by plain
``load_state_dict``, which maps none of them back: :func:`load_checkpoint_weights` renames them
with the model's own conversion mapping and refuses a checkpoint that would leave a parameter
of the model unrestored.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dflop_ds.jsonio import read_json_object

#: the sampler state file in every checkpoint folder
SAMPLER_STATE = "dflop_sampler.json"


def write_sampler_state(folder: str | os.PathLike, state: Mapping[str, Any]) -> Path:
    """Write ``state`` as :data:`SAMPLER_STATE` into ``folder`` (made if missing) atomically: a
    reader sees the whole file or none. Returns its path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / SAMPLER_STATE
    handle, temporary = tempfile.mkstemp(prefix=f".{SAMPLER_STATE}.", dir=folder)
    try:
        with os.fdopen(handle, "w") as out:
            json.dump(dict(state), out, indent=1)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


def read_sampler_state(checkpoint: str | os.PathLike) -> dict[str, Any]:
    """The :data:`SAMPLER_STATE` of ``checkpoint``; a checkpoint without one is a ``ValueError``
    naming the file and what to do instead (resuming by the step count alone would train some
    samples twice and others never)."""
    path = Path(checkpoint) / SAMPLER_STATE
    if not path.is_file():
        raise ValueError(
            f"{path}: no such file, so this checkpoint was not written by DFLOPTrainer (a plain Trainer's, or one"
            " cut off before the sampler state was written); resuming it by the Trainer's step count alone would"
            " train some samples twice and others never. Resume from a checkpoint that has it, resume this one"
            " with the Trainer that wrote it, or start training anew (resume_from_checkpoint=None)"
        )
    try:
        return read_json_object(path)
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: unreadable sampler state ({error}); resume from another checkpoint") from error


#: what a saved schedule must match, with why a change trains some samples twice and others never
SCHEDULE_KEYS = {
    "shape_policy": "the sample shapes were made under another shape policy (another model or processor)",
    "batches_per_epoch": "the dataset size, batch size or drop_last changed",
    "method": "the sampler kind (dflop.sampler.kind) changed, and with it which samples the epoch's batches hold",
    "memory_cap": "the memory cap (dflop.sampler.memory_cap_bytes) changed, and with it the samples it moves"
    " between the epoch's batches",
    "dataset_fingerprint": "the dataset's ids or shapes changed",
}


def saved_schedule(path: Path, saved: Mapping[str, Any]) -> dict[str, Any]:
    """The schedule inputs of a saved sampler state (:data:`SCHEDULE_KEYS`, ``memory_cap`` None
    when unset), refusing a state that lacks one or whose ``sampler`` is not an object, naming the
    file: a state that cannot be compared whole cannot be resumed exactly once."""
    sampler = saved.get("sampler")
    if not isinstance(sampler, Mapping):
        raise ValueError(f"{path}: 'sampler' must be the sampler's state object, got {type(sampler).__name__}")
    flat = {**sampler, **{k: saved[k] for k in ("shape_policy", "batches_per_epoch") if k in saved}}
    flat.setdefault("memory_cap", None)
    missing = sorted(set(SCHEDULE_KEYS) - set(flat))
    if missing:
        raise ValueError(
            f"{path}: no {', '.join(missing)} in it, so whether this run schedules the same epoch cannot be checked;"
            " resume from a checkpoint DFLOPTrainer wrote, or start training anew"
        )
    return {key: flat[key] for key in SCHEDULE_KEYS}


def check_saved_schedule(path: Path, saved: Mapping[str, Any], mine: Mapping[str, Any]) -> None:
    """Refuse a saved sampler state (the file's whole content) whose schedule inputs
    (:data:`SCHEDULE_KEYS`) differ from this run's ``mine`` or cannot be read, naming the file, the
    key and both values: the Trainer resumes by its step count, exact only for the same epoch."""
    theirs = saved_schedule(path, saved)
    for key, why in SCHEDULE_KEYS.items():
        if theirs[key] != mine.get(key):
            raise ValueError(
                f"{path}: saved with {key}={theirs[key]!r}, this run has {mine.get(key)!r}: {why}; resume with the"
                " run's own settings or start training anew"
            )


def schedule_identity(batch_sampler: Any, shape_policy: Any) -> dict[str, Any]:
    """What a checkpoint's sampler state records of ``batch_sampler``'s schedule besides the
    sampler's own state (:data:`SCHEDULE_KEYS`): global batches per epoch, the shapes'
    ``shape_policy`` (None for hand-made shapes), sampler kind, memory cap and dataset fingerprint."""
    policy = None if shape_policy is None else json.loads(json.dumps(shape_policy.describe()))
    sampler = batch_sampler.sampler.state_dict()
    return {
        "batches_per_epoch": batch_sampler.batches_per_epoch,
        "shape_policy": policy,
        "method": sampler["method"],
        "memory_cap": sampler.get("memory_cap"),
        "dataset_fingerprint": sampler["dataset_fingerprint"],
    }


def save_sampler_state(folder: str | os.PathLike, batch_sampler: Any, shape_policy: Any) -> Path:
    """Write ``batch_sampler``'s :data:`SAMPLER_STATE` into the checkpoint ``folder`` (atomically):
    what it schedules (seed, batch sizes, dataset fingerprint, shape policy, global batches per
    epoch), which a resume checks; where to resume is the Trainer's own state."""
    identity = schedule_identity(batch_sampler, shape_policy)
    state = {k: identity[k] for k in ("batches_per_epoch", "shape_policy")}
    return write_sampler_state(folder, {**state, "sampler": batch_sampler.sampler.state_dict()})


def save_before_checkpoint(trainer: Any, trial: Any, batch_sampler: Any, shape_policy: Any) -> None:
    """Write the sampler state into the folder ``trainer._save_checkpoint(model, trial)`` is about
    to fill (by the process that saves; nothing before the sampler exists): the Trainer resumes
    only a folder with ``trainer_state.json``, written last, so every checkpoint it can resume
    holds :data:`SAMPLER_STATE`."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    if batch_sampler is None or not trainer.args.should_save:
        return
    folder = Path(trainer._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}")
    save_sampler_state(folder, batch_sampler, shape_policy)


def resumed_checkpoint(resume_from_checkpoint: str | os.PathLike | bool | None, output_dir: str) -> str | None:
    """The checkpoint folder ``Trainer.train(resume_from_checkpoint)`` resumes: the path given, the
    last one in ``output_dir`` for ``True``, None for a fresh start."""
    if isinstance(resume_from_checkpoint, bool):
        if not resume_from_checkpoint:
            return None
        from transformers.trainer_utils import get_last_checkpoint

        return get_last_checkpoint(output_dir)
    return None if resume_from_checkpoint is None else str(resume_from_checkpoint)


def check_resume_state(checkpoint: str | os.PathLike, batch_sampler: Any, shape_policy: Any) -> None:
    """Refuse to resume ``batch_sampler`` from ``checkpoint`` without a sampler state (a plain
    Trainer's, or one cut off before it was written) or with one of another dataset, sample order,
    shape policy, seed, batch size, epoch length, sampler kind or memory cap (naming the file and
    both values); load the saved sampler state otherwise. Where to resume is the Trainer's: its
    epoch and step count."""
    saved = read_sampler_state(checkpoint)
    path = Path(checkpoint) / SAMPLER_STATE
    saved_schedule(path, saved)  # a state that cannot be compared whole is refused first
    try:
        batch_sampler.sampler.load_state_dict(dict(saved["sampler"]))
    except (KeyError, ValueError, TypeError) as error:
        raise ValueError(f"{path}: cannot resume this run from it: {error}") from error
    check_saved_schedule(path, saved, schedule_identity(batch_sampler, shape_policy))


def checkpoint_weight_files(checkpoint: str | os.PathLike) -> list[Path]:
    """The safetensors files of ``checkpoint``'s weights: its ``model.safetensors``, or the shards
    its ``model.safetensors.index.json`` lists; empty for another format."""
    folder = Path(checkpoint)
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return []
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, Mapping):
        raise ValueError(f"{index}: no weight_map of parameter names to shard files")
    return [folder / name for name in sorted(set(map(str, weight_map.values())))]


def load_checkpoint_weights(model: Any, checkpoint: str | os.PathLike) -> bool:
    """Load ``checkpoint``'s safetensors weights (one file or its shards, one shard in memory at a
    time) into ``model``, their keys renamed by the model's own conversion mapping (legacy names
    back to the module's). Returns False when the checkpoint holds none (another format: the
    Trainer's own loader applies); raises a ``ValueError`` naming the checkpoint and keys when a
    parameter of the model would stay unrestored."""
    files = checkpoint_weight_files(checkpoint)
    if not files:
        return False
    import safetensors.torch

    parameters = {name for name, _ in model.named_parameters()}
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    loaded: set[str] = set()
    for path in files:
        mapped = model_keys(model, safetensors.torch.load_file(str(path), device="cpu"))
        model.load_state_dict(mapped, strict=False)
        loaded |= set(mapped)
    missing = sorted(parameters - loaded - tied)
    if missing:
        raise ValueError(
            f"{files[0]}: {len(missing)} parameters of {type(model).__name__} are not in it under any name this"
            f" transformers maps (e.g. {', '.join(missing[:3])}); resuming would train fresh weights with the saved"
            " optimizer state. Resume with the transformers version and model class that saved it"
        )
    return True


def model_keys(model: Any, state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` with each key renamed as ``from_pretrained`` renames it for ``model`` (the
    renamings of its conversion mapping; a key no renaming matches stays as it is)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
    except ImportError:  # a transformers without conversion mappings saves the module's own names
        return dict(state)
    own = set(model.state_dict())
    renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    mapped = {}
    for key, tensor in state.items():
        renamed = key if key in own else rename_source_key(key, renamings, [])[0]
        mapped[renamed] = tensor
    return mapped


__all__ = [
    "SAMPLER_STATE",
    "SCHEDULE_KEYS",
    "saved_schedule",
    "check_resume_state",
    "check_saved_schedule",
    "resumed_checkpoint",
    "save_before_checkpoint",
    "save_sampler_state",
    "schedule_identity",
    "checkpoint_weight_files",
    "load_checkpoint_weights",
    "model_keys",
    "read_sampler_state",
    "write_sampler_state",
]
