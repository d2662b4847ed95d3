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

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from transformers import Trainer

from dflop_ds.compose import (
    RunInputs,
    TrainerTopology,
    block_sets_seed,
    build_trainer_sampler,
    dflop_block,
    dflop_settings,
    memory_cap,
    resolve_cost_model,
    run_settings,
    train_loader,
)
from dflop_ds.cost import CostModel
from dflop_ds.hf_trainer.block_rules import freeze_vision_encoder
from dflop_ds.hf_trainer.guard import BlankImageGuardMixin
from dflop_ds.hf_trainer.launcher import check_batch_keys, trainer_deepspeed_config
from dflop_ds.hf_trainer.loss import step_token_loss
from dflop_ds.hf_trainer.packing import chosen_collator, packing_collator, use_segment_attention
from dflop_ds.hf_trainer.resume import (
    SAMPLER_STATE,
    check_resume_state,
    load_checkpoint_weights,
    resumed_checkpoint,
    save_before_checkpoint,
    save_sampler_state,
)
from dflop_ds.hf_trainer.sampler import TrainerBatchSampler, TrainerDataLoader
from dflop_ds.hf_trainer.shape_checks import check_shapes
from dflop_ds.hf_trainer.shapes import ShapeTable
from dflop_ds.hf_trainer.version import check_transformers_version, epoch_adapters
from dflop_ds.rank_lifecycle import release_shm_buffer_once_mapped
from dflop_ds.shapes import SampleShape

logger = logging.getLogger(__name__)


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
        self._dflop_run = run_settings(dflop, deepspeed, deepspeed_source)
        self.dflop_settings = self._dflop_run.config
        #: how the ranks meet (no pipeline under the Trainer), from the DeepSpeed config
        self.dflop_sync = self._dflop_run.sync
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
            # its forward would return a per-microbatch mean, which uneven microbatches distort
            logger.info(
                "DFLOPTrainer: %s takes no num_items_in_batch; training with the step's token-mean loss"
                " (dflop_ds.hf_trainer.loss.step_token_loss)",
                type(trainer.model).__name__,
            )
            trainer.compute_loss_func = step_token_loss(trainer.model)
        #: the shape policy of the shape helpers' tables (checked against the cost model's)
        self.shape_policy = getattr(sample_shapes, "policy", None)
        self.sample_shapes = None if sample_shapes is None else list(sample_shapes)
        if trainer.train_dataset is not None and self.sample_shapes is not None:
            check_shapes(self.sample_shapes, trainer.train_dataset)
        if isinstance(sample_shapes, ShapeTable) and not any(shape.video_frames > 0 for shape in sample_shapes):
            # the shape helpers counted no video in the data: no second tower call to pair under ZeRO-3
            self._pair_videos = False
        self.dflop_batch_sampler: TrainerBatchSampler | None = None
        self._dflop_resume: str | None = None
        for adapter in epoch_adapters(lambda: self.dflop_batch_sampler):
            trainer.add_callback(adapter)

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
        seed, seed_source = self._dflop_seed()
        inputs = RunInputs(
            self.dflop_settings, self.sample_shapes, self._dflop_cost_model(), seed, seed_source, self.dflop_sync
        )
        topology = TrainerTopology.of_trainer(trainer)
        return build_trainer_sampler(inputs, topology)

    def _dflop_cost_model(self) -> CostModel | None:
        """The cost model ``dflop.sampler.cost_model`` names (None: the proxy), checked against the
        shapes' policy (when the shape helpers made them) and the model's depth (LLaVA, Qwen2-VL);
        with ``dflop.model.packing=true`` wrapped for packed microbatches."""
        trainer: Any = self
        return resolve_cost_model(self.dflop_settings, self.shape_policy, trainer.model)

    def _dflop_seed(self) -> tuple[int, str]:
        """``(seed, where it came from)`` of the data order: ``dflop.train.seed`` when the block
        sets it (0 included), else the Trainer's ``data_seed`` or ``seed``."""
        trainer: Any = self
        return self._dflop_run.seed(trainer.args.data_seed, trainer.args.seed)

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
        return train_loader(dataset, batch_sampler, collator, trainer.args)

    # -- telemetry ---------------------------------------------------------------------------
    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The Trainer's log, with the scheduler's telemetry since the last training log
        (``dflop_predicted_imbalance``: mean slowest / mean microbatch cost;
        ``dflop_predicted_step_over_bound``: mean predicted step over its lower bound under the
        run's sync model; ``dflop_predicted_step_s``: the mean predicted step in the cost model's
        seconds; ``dflop_schedule_s``)."""
        if "loss" in logs and self.dflop_batch_sampler is not None:
            logs = {**logs, **self.dflop_batch_sampler.log.drain()}
        super().log(logs, *args, **kwargs)  # type: ignore[misc]

    # -- checkpoints ---------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; a resumed run checks the checkpoint's sampler state first."""
        trainer: Any = self
        self._dflop_resume = resumed_checkpoint(resume_from_checkpoint, trainer.args.output_dir)
        return super().train(resume_from_checkpoint, *args, **kwargs)  # type: ignore[misc]

    def _check_resume_state(self, batch_sampler: TrainerBatchSampler) -> None:
        """On resume, the checkpoint's sampler state checked against this run's schedule
        (:func:`~dflop_ds.hf_trainer.resume.check_resume_state`)."""
        if self._dflop_resume is not None:
            check_resume_state(self._dflop_resume, batch_sampler, self.shape_policy)

    def _save_sampler_state(self, checkpoint_dir: str) -> None:
        """Write the sampler state into ``checkpoint_dir``
        (:func:`~dflop_ds.hf_trainer.resume.save_sampler_state`)."""
        if self.dflop_batch_sampler is not None:
            save_sampler_state(checkpoint_dir, self.dflop_batch_sampler, self.shape_policy)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """The Trainer's checkpoint, its sampler state written first
        (:func:`~dflop_ds.hf_trainer.resume.save_before_checkpoint`)."""
        save_before_checkpoint(self, trial, self.dflop_batch_sampler, self.shape_policy)
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
