"""``DFLOPTrainerMixin``: DFLOP's balanced microbatches in a ``transformers.Trainer`` (or TRL's).

The mixin replaces the Trainer's training sampler and data loader and nothing else: the user's
model, collator, optimizer, logging, checkpointing and evaluation stay. What it guarantees:

* each data-parallel rank yields exactly ``gradient_accumulation_steps`` microbatches per
  optimizer step, of any sample count, cut from one global batch of ``per_device_train_batch_size
  x gradient_accumulation_steps x dp`` samples by the sampler named in the ``"dflop"`` block
  (balanced on predicted cost, padded to the longest sample since the user's collator pads; with
  ``dflop.model.packing=true``, padding free: balanced on the packed cost, the samples' own
  attention, :mod:`dflop_ds.hf_trainer.packing`);
  tensor-parallel peers get identical microbatches;
* Accelerate never re-shards or pads them: the loader is not passed through ``accelerator.prepare``
  (the Trainer moves each batch to its device itself);
* the loss stays the global batch's label-token mean through the Trainer's own
  ``num_items_in_batch`` (labels counted over the step's microbatches and summed over ranks), which
  is why ``average_tokens_across_devices`` must stay on;
* a LLaVA microbatch without images gets a blank image masked out of attention and loss
  (:mod:`dflop_ds.hf_trainer.guard`), so ZeRO's gradient reduction matches across ranks;
* resume: the Trainer's own epoch and skip arithmetic lands on the next untrained microbatch
  (:mod:`dflop_ds.hf_trainer.sampler`); the sampler's state is written into every checkpoint
  folder before the Trainer's own state and checked on resume, so a checkpoint without it (a
  plain Trainer's) or of another dataset, order, shape policy, seed or batch size is refused by
  name; without DeepSpeed the weights are loaded with their legacy names mapped back
  (:mod:`dflop_ds.hf_trainer.resume`);
* the ranks agree before the first step: each rank digests its shape table, cost model, seed and
  sampler settings and one ``all_gather_object`` compares them
  (:mod:`dflop_ds.hf_trainer.agreement`), so ranks never train different splits; the cost model is
  checked against the shapes' policy and the model's depth, and a time-limited solver
  (``time_limit_s > 0``) is refused with more than one rank, as in the training loop;
* the predicted imbalance and the scheduler's time join the Trainer's logs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint, seed_worker

from dflop_ds.config import AUTO, OFF, DFLOPConfig
from dflop_ds.cost import PackedCost, load_cost_model, sampler_cost_model
from dflop_ds.hf_trainer.agreement import check_ranks_agree, model_depths, trainer_input_digests
from dflop_ds.hf_trainer.block_rules import check_trainer_block, freeze_vision_encoder
from dflop_ds.hf_trainer.guard import BlankImageGuardMixin
from dflop_ds.hf_trainer.launcher import check_batch_keys, trainer_deepspeed_config
from dflop_ds.hf_trainer.packing import chosen_collator, packing_collator, use_segment_attention
from dflop_ds.hf_trainer.resume import (
    SAMPLER_STATE,
    check_saved_schedule,
    load_checkpoint_weights,
    read_sampler_state,
    saved_schedule,
    write_sampler_state,
)
from dflop_ds.hf_trainer.sampler import (
    TrainerBatchSampler,
    TrainerDataLoader,
    last_step_microbatches,
    trainer_data_parallel_coords,
)
from dflop_ds.hf_trainer.shape_checks import check_shapes
from dflop_ds.hf_trainer.version import check_transformers_version
from dflop_ds.jsonio import read_json_object
from dflop_ds.rank_lifecycle import release_shm_buffer_once_mapped
from dflop_ds.schedule import make_sampler
from dflop_ds.setup_checks import check_cost_model_fits, check_time_limit
from dflop_ds.shapes import SampleShape
from dflop_ds.sync import sync_model_of
from dflop_ds.train.options import sampler_settings

logger = logging.getLogger(__name__)


def dflop_block(
    dflop: Mapping[str, Any] | None, deepspeed: Any, deepspeed_source: str = "TrainingArguments.deepspeed"
) -> tuple[dict[str, Any], str]:
    """``(block, source)``: ``dflop`` (a ``"dflop"`` block) if given, else the ``"dflop"`` block of
    the DeepSpeed config ``deepspeed`` (``TrainingArguments.deepspeed``, a path, or a dict from
    ``deepspeed_source``), else an empty block; ``source`` names where it came from. A block that
    is not a dict, or sets a key the Trainer does not honour, is refused naming it
    (:func:`~dflop_ds.hf_trainer.block_rules.check_trainer_block`)."""
    if dflop is not None:
        block, source = dflop, "DFLOPTrainer(dflop=...)"
    elif deepspeed is None:
        block, source = {}, "defaults"
    elif isinstance(deepspeed, Mapping):
        block, source = deepspeed.get("dflop", {}), deepspeed_source
    else:
        block, source = read_json_object(deepspeed).get("dflop", {}), str(deepspeed)
    check_trainer_block(block, source)
    return dict(block), source


def dflop_settings(dflop: Mapping[str, Any] | None, deepspeed: Any) -> DFLOPConfig:
    """The typed settings of :func:`dflop_block`'s block (the defaults where it sets nothing). A bad
    block is a ``ValueError`` naming the key and where it came from."""
    block, source = dflop_block(dflop, deepspeed)
    return DFLOPConfig.from_dict(block, source=source)


def block_sets_seed(block: Mapping[str, Any]) -> bool:
    """Whether a ``"dflop"`` block sets ``train.seed`` itself (0 included)."""
    train = block.get("train")
    return isinstance(train, Mapping) and "seed" in train


def memory_cap(settings: DFLOPConfig) -> float | None:
    """``dflop.sampler.memory_cap_bytes`` as the sampler takes it: a number, or None for ``"off"``
    and the default ``"auto"`` left unset (the Trainer runs no plan and measures no device budget,
    so a block that sets ``"auto"`` is refused by :func:`dflop_block`)."""
    cap = settings.sampler.memory_cap_bytes
    return None if cap in (AUTO, OFF) else float(cap)


def epochs_to_train(args: Any, batches_per_epoch: int) -> int:
    """The epochs a Trainer run with ``args`` (``TrainingArguments``) reaches: those ``max_steps``
    optimizer steps span when set (one step per global batch), else ``num_train_epochs`` rounded up."""
    if args.max_steps is not None and args.max_steps > 0:
        return max(1, math.ceil(args.max_steps / max(1, batches_per_epoch)))
    return max(1, math.ceil(args.num_train_epochs))


class DFLOPTrainerMixin(BlankImageGuardMixin):
    """Put before ``transformers.Trainer`` (or a subclass such as TRL's ``SFTTrainer``) in the bases.

    Takes every argument of the Trainer, plus:

    Args:
        dflop: the settings, a dict in the shape of the DeepSpeed config's ``"dflop"`` block
            (``{"sampler": {"kind": "dflop", "cost_model": "costmodel.json"}}``); default: the
            ``"dflop"`` block of the DeepSpeed config (``TrainingArguments.deepspeed``, or the
            ``deepspeed_config_file`` of ``accelerate launch``'s DeepSpeed plugin). Of it the
            Trainer honours the ``sampler`` section, ``train.seed`` (default:
            ``TrainingArguments.seed``), ``model.packing`` and ``model.freeze_encoder``; any other
            key is refused naming the Trainer's own way to get it
            (:mod:`dflop_ds.hf_trainer.block_rules`). The config's batch keys may be ``"auto"`` or
            numbers equal to ``TrainingArguments``' (another value is refused here, naming both).
        sample_shapes: one :class:`~dflop_ds.shapes.SampleShape` per index of ``train_dataset``
            (e.g. :func:`~dflop_ds.hf_trainer.llava_json_shapes`); required for training.
    """

    def __init__(
        self,
        *args: Any,
        dflop: Mapping[str, Any] | None = None,
        sample_shapes: Sequence[SampleShape] | None = None,
        **kwargs: Any,
    ) -> None:
        check_transformers_version()
        # Trainer(model, args, data_collator, ...): the collator the user passed, if any
        user_collator = kwargs.get("data_collator", args[2] if len(args) > 2 else None)
        super().__init__(*args, **kwargs)
        trainer: Any = self
        # DeepSpeed's CPU all-reduce buffer in /dev/shm, mapped by every rank by now: unlinked, so
        # that nothing is left behind however the run ends (as the DeepSpeed loop does)
        release_shm_buffer_once_mapped()
        deepspeed, deepspeed_source = trainer_deepspeed_config(trainer)  # from either launcher
        check_batch_keys(trainer, deepspeed_source)
        block, source = dflop_block(dflop, deepspeed, deepspeed_source)
        self.dflop_settings = DFLOPConfig.from_dict(block, source=source)
        #: how the ranks meet (no pipeline under the Trainer), from the DeepSpeed config
        self.dflop_sync = sync_model_of(
            deepspeed if isinstance(deepspeed, Mapping) else read_json_object(deepspeed) if deepspeed else {}
        )
        self._dflop_seed_source = f"{source}: train.seed" if block_sets_seed(block) else None
        if self.dflop_settings.model.freeze_encoder:
            freeze_vision_encoder(trainer.model)
        if self.dflop_settings.model.packing:
            trainer.data_collator = packing_collator(
                trainer.model, chosen_collator(user_collator, trainer.data_collator)
            )
            use_segment_attention(trainer.model)
        if not trainer.args.average_tokens_across_devices:
            raise ValueError(
                "DFLOPTrainer needs TrainingArguments(average_tokens_across_devices=True): its microbatches differ"
                " in size, so the loss must be divided by the label tokens of the whole step over all ranks"
            )
        if not (trainer.model_accepts_loss_kwargs or trainer.compute_loss_func is not None):
            raise ValueError(
                f"DFLOPTrainer: the model {type(trainer.model).__name__} does not take num_items_in_batch in"
                " forward, so its loss would be a per-microbatch mean, which uneven microbatches distort; pass"
                " compute_loss_func= that divides by num_items_in_batch"
            )
        #: the shape policy of the shape helpers' tables (checked against the cost model's)
        self.shape_policy = getattr(sample_shapes, "policy", None)
        self.sample_shapes = None if sample_shapes is None else list(sample_shapes)
        if trainer.train_dataset is not None and self.sample_shapes is not None:
            check_shapes(self.sample_shapes, trainer.train_dataset)
        self.dflop_batch_sampler: TrainerBatchSampler | None = None
        self._dflop_resume: str | None = None

    # -- the sampler and loader -------------------------------------------------------------
    def _get_train_sampler(self, train_dataset: Any = None) -> TrainerBatchSampler:
        """The training batch sampler: this rank's microbatches of DFLOP's global batches."""
        trainer: Any = self
        dataset = trainer.train_dataset if train_dataset is None else train_dataset
        if self.sample_shapes is None:
            raise ValueError(
                "DFLOPTrainer needs sample_shapes=: one SampleShape per index of train_dataset"
                " (dflop_ds.hf_trainer.llava_json_shapes(data_path, model_name_or_path, image_folder=...))"
            )
        check_shapes(self.sample_shapes, dataset)
        args, settings = trainer.args, self.dflop_settings
        world = max(1, args.world_size)
        dp_rank, dp_size = trainer_data_parallel_coords(args.process_index, world, trainer.get_tp_size())
        check_time_limit(settings, world)  # every rank computes the schedule itself
        gas = args.gradient_accumulation_steps
        cap = memory_cap(settings)
        options: dict[str, Any] = {"memory_cap": cap, "allow_oversize": settings.sampler.allow_oversize} if cap else {}
        cost_model = self._dflop_cost_model()
        seed, seed_source = self._dflop_seed()
        drop_last = settings.sampler.drop_last or args.dataloader_drop_last
        global_batch = args.per_device_train_batch_size * gas * dp_size
        digested_settings = {
            "kind": settings.sampler.kind,
            "global_batch_size": global_batch,
            "gradient_accumulation_steps": gas,
            "dp_size": dp_size,
            "drop_last": drop_last,
            "ilp_nodes": settings.sampler.ilp_nodes,
            **options,
        }
        check_ranks_agree(
            trainer_input_digests(
                self.sample_shapes,
                cost_model,
                settings.sampler.cost_model or "the unitless proxy",
                seed,
                seed_source,
                digested_settings,
                args.process_index,
            )
        )
        build = partial(
            make_sampler,
            # epochs are cut by TrainerBatchSampler
            dataclasses.replace(sampler_settings(settings), seed=seed, drop_last=False),
            self.sample_shapes,
            dp_rank=dp_rank,
            dp_size=dp_size,
            cost_model=cost_model,
            sync=self.dflop_sync,
            memory_cap=cap,
        )
        last_gas = last_step_microbatches(len(self.sample_shapes), global_batch, gas, dp_size, drop_last)
        batch_sampler = TrainerBatchSampler(
            build(global_batch_size=global_batch, gradient_accumulation_steps=gas),
            drop_last=drop_last,
            last_step_sampler=None
            if last_gas == gas
            else build(global_batch_size=len(self.sample_shapes) % global_batch, gradient_accumulation_steps=last_gas),
        )
        # a memory cap the batches of some epoch cannot meet is an error now, before step 0
        batch_sampler.check_epochs(epochs_to_train(args, batch_sampler.batches_per_epoch))
        return batch_sampler

    def _dflop_cost_model(self) -> Any:
        """The cost model ``dflop.sampler.cost_model`` names (None: the proxy), checked against the
        shapes' policy (when the shape helpers made them) and the model's depth (LLaVA, Qwen2-VL);
        with ``dflop.model.packing=true`` wrapped for packed microbatches."""
        trainer: Any = self
        path = self.dflop_settings.sampler.cost_model
        packed = bool(self.dflop_settings.model.packing)
        if path is None:
            return sampler_cost_model(None, packed=True) if packed else None
        cost_model = load_cost_model(path)
        if packed and isinstance(cost_model, PackedCost):
            raise ValueError(
                f"{path}: this cost model is already packed and dflop.model.packing=true packs it again:"
                " name the profiled (unpacked) cost model"
            )
        depths = model_depths(trainer.model)
        check_cost_model_fits(
            cost_model,
            self.shape_policy,
            encoder_layers=None if depths is None else depths[0],
            llm_layers=None if depths is None else depths[1],
            source=str(path),
        )
        return sampler_cost_model(cost_model, packed=packed)

    def _dflop_seed(self) -> tuple[int, str]:
        """``(seed, where it came from)`` of the data order: ``dflop.train.seed`` when the block
        sets it (0 included), else the Trainer's ``data_seed`` or ``seed``."""
        trainer: Any = self
        if self._dflop_seed_source is not None:
            return self.dflop_settings.train.seed, self._dflop_seed_source
        if trainer.args.data_seed is not None:
            return int(trainer.args.data_seed), "TrainingArguments.data_seed"
        return int(trainer.args.seed), "TrainingArguments.seed"

    def get_train_dataloader(self) -> TrainerDataLoader:
        """The training loader: the user's collator over :meth:`_get_train_sampler`'s microbatches,
        not passed through ``accelerator.prepare`` (which would shard and pad them again)."""
        trainer: Any = self
        if trainer.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        dataset, collator = trainer.train_dataset, trainer.data_collator
        if _is_hf_dataset(dataset):
            dataset = trainer._remove_unused_columns(dataset, description="Training")
        else:
            collator = trainer._get_collator_with_removed_columns(collator, description="Training")
        batch_sampler = self._get_train_sampler(dataset)
        self._check_resume_state(batch_sampler)
        self.dflop_batch_sampler = batch_sampler
        args = trainer.args
        workers = args.dataloader_num_workers
        return TrainerDataLoader(
            dataset,
            batch_sampler=batch_sampler,
            collate_fn=collator,
            num_workers=workers,
            pin_memory=args.dataloader_pin_memory,
            persistent_workers=args.dataloader_persistent_workers and workers > 0,
            prefetch_factor=args.dataloader_prefetch_factor if workers > 0 else None,
            worker_init_fn=partial(seed_worker, num_workers=workers, rank=args.process_index),
        )

    # -- telemetry ---------------------------------------------------------------------------
    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The Trainer's log, with the scheduler's telemetry since the last training log
        (``dflop_predicted_imbalance``: mean slowest / mean microbatch cost; ``dflop_schedule_s``)."""
        if "loss" in logs and self.dflop_batch_sampler is not None:
            logs = {**logs, **self.dflop_batch_sampler.log.drain()}
        super().log(logs, *args, **kwargs)  # type: ignore[misc]

    # -- checkpoints ---------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; a resumed run checks the checkpoint's sampler state first."""
        trainer: Any = self
        self._dflop_resume = None
        if isinstance(resume_from_checkpoint, bool) and resume_from_checkpoint:
            self._dflop_resume = get_last_checkpoint(trainer.args.output_dir)
        elif isinstance(resume_from_checkpoint, (str, os.PathLike)):
            self._dflop_resume = str(resume_from_checkpoint)
        return super().train(resume_from_checkpoint, *args, **kwargs)  # type: ignore[misc]

    def _check_resume_state(self, batch_sampler: TrainerBatchSampler) -> None:
        """Refuse to resume from a checkpoint without a sampler state (a plain Trainer's, or one cut
        off before it was written) or with one of another dataset, sample order, shape policy, seed,
        batch size, epoch length, sampler kind or memory cap (naming the file and both values). Where to resume is the
        Trainer's: its epoch and step count."""
        if self._dflop_resume is None:
            return
        saved = read_sampler_state(self._dflop_resume)
        path = Path(self._dflop_resume) / SAMPLER_STATE
        saved_schedule(path, saved)  # a state that cannot be compared whole is refused first
        try:
            batch_sampler.sampler.load_state_dict(dict(saved["sampler"]))
        except (KeyError, ValueError, TypeError) as error:
            raise ValueError(f"{path}: cannot resume this run from it: {error}") from error
        check_saved_schedule(path, saved, self._schedule_identity(batch_sampler))

    def _schedule_identity(self, batch_sampler: TrainerBatchSampler) -> dict[str, Any]:
        """What a checkpoint's sampler state records of the schedule besides the sampler's own
        state: global batches per epoch and the shapes' policy (None for hand-made shapes)."""
        policy = None if self.shape_policy is None else json.loads(json.dumps(self.shape_policy.describe()))
        sampler = batch_sampler.sampler.state_dict()
        return {
            "batches_per_epoch": batch_sampler.batches_per_epoch,
            "shape_policy": policy,
            "method": sampler["method"],
            "memory_cap": sampler.get("memory_cap"),
            "dataset_fingerprint": sampler["dataset_fingerprint"],
        }

    def _save_sampler_state(self, checkpoint_dir: str) -> None:
        """Write into ``checkpoint_dir`` (atomically) what the sampler schedules (seed, batch sizes,
        dataset fingerprint, shape policy, global batches per epoch), which a resume checks; where
        to resume is the Trainer's own state."""
        batch_sampler = self.dflop_batch_sampler
        if batch_sampler is None:
            return
        identity = self._schedule_identity(batch_sampler)
        state = {k: identity[k] for k in ("batches_per_epoch", "shape_policy")}
        write_sampler_state(checkpoint_dir, {**state, "sampler": batch_sampler.sampler.state_dict()})

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """The Trainer's checkpoint, its sampler state written first (by the process that saves):
        the Trainer resumes only a folder with ``trainer_state.json``, written last, so every
        checkpoint it can resume holds :data:`SAMPLER_STATE`."""
        trainer: Any = self
        if trainer.args.should_save:
            folder = Path(trainer._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}")
            self._save_sampler_state(str(folder))
        super()._save_checkpoint(model, trial)  # type: ignore[misc]

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """The checkpoint's weights into the model (no DeepSpeed): safetensors weights (one file or shards)
        with its legacy key names mapped back (:func:`~dflop_ds.hf_trainer.resume.load_checkpoint_weights`,
        which refuses one that leaves a parameter unrestored); any other format by the Trainer."""
        trainer: Any = self
        target = trainer.model if model is None else model
        if hasattr(target, "get_base_model") or not load_checkpoint_weights(target, resume_from_checkpoint):
            super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]


def _is_hf_dataset(dataset: Any) -> bool:
    try:
        import datasets
    except ImportError:
        return False
    return isinstance(dataset, datasets.Dataset)


class DFLOPTrainer(DFLOPTrainerMixin, Trainer):
    """``transformers.Trainer`` with DFLOP's balanced microbatches: every Trainer argument, plus
    ``dflop=`` and ``sample_shapes=`` (see :class:`DFLOPTrainerMixin`)."""


__all__ = [
    "SAMPLER_STATE",
    "DFLOPTrainer",
    "DFLOPTrainerMixin",
    "block_sets_seed",
    "check_shapes",
    "dflop_block",
    "dflop_settings",
    "memory_cap",
]
