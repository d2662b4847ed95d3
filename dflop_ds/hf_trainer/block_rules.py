"""Which keys of the ``"dflop"`` block the Trainer honours, and a refusal naming the others.

The block is shared with the DeepSpeed training loop (``dflop-ds train``), which honours every
key. The Trainer honours the ``sampler`` section (``memory_cap_bytes`` as a number or ``"off"``:
it measures no device budget, so ``"auto"`` is the loop's), ``train.seed``, ``model.packing`` and
``model.freeze_encoder`` (the family's vision encoder frozen before the optimizer is built). A
key it does not honour is refused by :func:`check_trainer_block`, naming the key, the Trainer and
the Trainer's own way to get the same, instead of being ignored in silence (a ``model.lora`` or
``train.lr`` ignored changes what is trained).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dflop_ds.config import AUTO, DFLOPConfig, get_setting, setting_names

#: setting name -> what to use in the Trainer instead (every setting not listed is honoured)
TRAINER_INSTEAD = {
    "data": "the Trainer reads train_dataset= and sample_shapes= (make them from the data file,"
    " e.g. llava_json_shapes(path, model_dir, image_folder=...))",
    "max_samples": "pass a train_dataset (and sample_shapes) of that many samples",
    "on_bad_sample": "shape helpers refuse a bad record by name; drop it from the data file",
    "policy": "the shape helpers take the policy from the model's processor",
    "image_folder": "llava_json_shapes(..., image_folder=...) and your Dataset",
    "video_folder": "llava_json_shapes(..., video_folder=...) and your Dataset",
    "video_fps": "your Dataset and processor sample the frames",
    "video_max_frames": "your Dataset and processor sample the frames",
    "max_length": "llava_json_shapes(..., max_length=...) and your collator's truncation",
    "truncation": "your collator's truncation",
    "num_workers": "TrainingArguments(dataloader_num_workers=...)",
    "model_name_or_path": "the Trainer trains the model= you pass",
    "model": "the Trainer trains the model= you pass",
    "activation_checkpointing": "TrainingArguments(gradient_checkpointing=True)",
    "encoder": "the colocated encoder is the DeepSpeed loop's (dflop-ds train); the Trainer encodes locally",
    "lora": "wrap the model with peft.get_peft_model(model, LoraConfig(...)) before passing it",
    "plan": "the Trainer runs no pipeline plan: use TrainingArguments / the DeepSpeed config's ZeRO settings",
    "pipeline_stages": "the Trainer runs no pipeline (use the DeepSpeed loop, dflop-ds train, for one)",
    "stage_bounds": "the Trainer runs no pipeline (use the DeepSpeed loop, dflop-ds train, for one)",
    "steps": "TrainingArguments(max_steps=...)",
    "warmup_steps": "TrainingArguments(warmup_steps=...)",
    "lr": "TrainingArguments(learning_rate=...)",
    "checkpoint_dir": "TrainingArguments(output_dir=...)",
    "checkpoint_every": "TrainingArguments(save_steps=...)",
    "resume": "trainer.train(resume_from_checkpoint=...)",
    "telemetry": "the Trainer logs dflop_predicted_imbalance and dflop_schedule_s itself",
    "correction": "the adaptive correction needs the DeepSpeed loop's telemetry (dflop-ds train)",
    "fault": "fault injection is for the DeepSpeed loop's tests",
}


def trainer_block_problems(block: Mapping[str, Any]) -> list[str]:
    """One line per key of ``block`` (a ``"dflop"`` block) the Trainer does not honour, naming its
    path and what to use instead; empty when it honours them all."""
    problems = []
    for name in setting_names():
        value = get_setting(dict(block), name)
        if value is None:
            continue
        path = DFLOPConfig.path(name)
        if name in TRAINER_INSTEAD:
            problems.append(f"{path}: {TRAINER_INSTEAD[name]}")
        elif name == "memory_cap_bytes" and value == AUTO:
            problems.append(f'{path}="auto": the Trainer measures no device budget; give the cap in bytes, or "off"')
    return problems


def check_trainer_block(block: Any, source: str) -> None:
    """Refuse a ``"dflop"`` block from ``source`` that is not a mapping, or that sets a key the
    Trainer does not honour (every such key named, with what to use instead)."""
    if not isinstance(block, Mapping):
        raise TypeError(
            f'{source}: the dflop settings must be a dict in the shape of the DeepSpeed config\'s "dflop" block'
            f' (e.g. {{"sampler": {{"kind": "dflop"}}}}), got {type(block).__name__} {block!r}'
        )
    problems = trainer_block_problems(block)
    if problems:
        raise ValueError(
            f"{source}: DFLOPTrainer does not honour these dflop keys (the DeepSpeed loop, dflop-ds train, does);"
            " remove them and use instead:\n  " + "\n  ".join(problems)
        )


def freeze_vision_encoder(model: Any) -> int:
    """Freeze the vision encoder of ``model`` (a registered family's, or a PEFT wrapper of one) as
    ``dflop.model.freeze_encoder`` asks: its parameters stop requiring gradients (the projector and
    language model train). Returns the parameters frozen; a model whose encoder dflop-ds cannot
    find is a ``ValueError`` naming the key."""
    from dflop_ds.models.hf.registry import family_for

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    kind = getattr(getattr(base, "config", None), "model_type", None)
    try:
        encoder, _, _ = family_for(kind, "dflop.model.freeze_encoder").training().layers(base)
    except (AttributeError, ValueError) as error:
        raise ValueError(
            f"dflop.model.freeze_encoder: cannot find the vision encoder of {type(base).__name__} ({error});"
            " set requires_grad=False on its parameters yourself and leave the key out"
        ) from error
    frozen = 0
    for layer in encoder:
        for parameter in layer.parameters():
            if parameter.requires_grad:
                parameter.requires_grad_(False)
                frozen += 1
    return frozen


__all__ = ["TRAINER_INSTEAD", "check_trainer_block", "freeze_vision_encoder", "trainer_block_problems"]
