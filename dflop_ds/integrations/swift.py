"""DFLOP in ms-swift: ``swift sft ... --deepspeed ds.json --external_plugins "$(dflop-ds plugin-path
swift)" --callbacks dflop``.

ms-swift's trainer builds its own rank-sharded loader (``DataLoaderMixin.get_train_dataloader``), so
its ``_get_train_sampler`` is never asked. It builds every ``--callbacks NAME`` as
``callbacks_map[NAME](args, trainer)`` before the Trainer's own ``__init__``: the ``dflop`` callback
(:class:`DFLOPSwiftCallback`) puts its own ``get_train_dataloader`` on that trainer, which yields
this rank's DFLOP microbatches (:func:`dflop_ds.compose.build_trainer_sampler`) through ms-swift's
own collator. What it reads:

* settings: the ``"dflop"`` block of the ``--deepspeed`` config (ms-swift keeps it as a dict);
* shapes: the training rows' ``messages`` and their images' headers (:mod:`.chat`), in the
  dataset's index order: nothing is encoded or decoded, so ``lazy_tokenize`` (ms-swift's default
  for multimodal data) needs nothing else;
* the model's folder (``model_info.model_dir``): the family's shape policy;
* ``--padding_free true``: ms-swift packs each microbatch into one row, so the sampler balances the
  packed cost: each sample's attention apart under flash attention, the whole row's under SDPA or
  eager (they run the row's block-diagonal mask densely; :class:`~dflop_ds.cost.RowPackedCost`).
  ``--packing true`` is refused: its rows are packs made offline, fixed before DFLOP
  sees them; ``--padding_free true`` is the alternative. ``--streaming``, ``--group_by_length``
  and sequence parallelism are refused too (each brings a sampler of its own).

Exactly once: the ranks cut each epoch's seeded permutation into global batches and split them
(:class:`~dflop_ds.hf_trainer.sampler.TrainerBatchSampler`); the Trainer's ``set_epoch`` and its
resume arithmetic land on the next untrained microbatch. As with ``DFLOPTrainer``, every
checkpoint holds the sampler state (written before ms-swift's own files) and a resume checks it
(:mod:`dflop_ds.hf_trainer.resume`): a checkpoint without one, or of another dataset, seed, batch
size, sampler kind or memory cap, is refused by name, since the step count alone would land
elsewhere in another schedule. A memory cap that some global batch of the run cannot meet is an
error before step 0 (:func:`dflop_ds.compose.build_trainer_sampler`). ms-swift's ``LazyLLMDataset`` would fetch
another, random row in place of one its template refuses (``strict false``, the default): the
plugin makes such a row an error instead (one fetch per index), so no row trains twice.
"""

from __future__ import annotations

import logging
from typing import Any

from transformers import TrainerCallback

from dflop_ds.compose import (
    RunInputs,
    TrainerTopology,
    attends_per_sample,
    build_trainer_sampler,
    resolve_cost_model,
    run_settings,
    train_loader,
)
from dflop_ds.hf_trainer.guard import blank_image_for, guarded_batch
from dflop_ds.hf_trainer.resume import check_resume_state, resumed_checkpoint, save_before_checkpoint
from dflop_ds.integrations.chat import chat_shapes
from dflop_ds.models.hf.preprocessor import hf_preprocessor
from dflop_ds.zero_gather import start_ranks_before_loading

logger = logging.getLogger(__name__)

#: the name ``--callbacks`` takes
CALLBACK = "dflop"


def register() -> None:
    """Add the ``dflop`` callback to ms-swift's ``callbacks_map`` and start DeepSpeed's
    communication now, under a multi-process launch: ``from_pretrained``'s ZeRO-3 ``zero.Init``
    runs before the Trainer starts it and would otherwise count one process (the CPU launchers'
    quirk, docs/hf_trainer.md)."""
    from swift.callbacks import callbacks_map

    callbacks_map[CALLBACK] = DFLOPSwiftCallback
    start_ranks_before_loading()


def refuse_unsupported(args: Any, trainer: Any) -> None:
    """Refuse, by option and with the alternative, what brings its own sampler or order."""
    if getattr(args, "group_by_length", False):
        raise ValueError(
            "--callbacks dflop: --group_by_length sorts batches by token length itself; drop it (DFLOP balances"
            " every microbatch by its predicted encoder and LLM cost)"
        )
    if getattr(trainer.template, "sequence_parallel_size", 1) > 1:
        raise ValueError("--callbacks dflop: sequence parallelism has its own sampler; drop --sequence_parallel_size")


#: the ``"dflop"`` block's model options the Trainer honours that ms-swift does itself, with its option
SWIFT_INSTEAD = {"packing": "--padding_free true", "freeze_encoder": "--freeze_vit true"}


def refuse_model_options(settings: Any, source: str) -> None:
    """Refuse ``dflop.model.packing`` / ``freeze_encoder`` (honoured by ``DFLOPTrainer``, not here:
    ms-swift builds the collator and freezes modules itself), naming ms-swift's own option."""
    for key, option in SWIFT_INSTEAD.items():
        if getattr(settings.model, key):
            raise ValueError(f"{source}: dflop.model.{key}: ms-swift does this itself: drop it and pass {option}")


def guard_image_free_microbatches(trainer: Any) -> None:
    """Give a microbatch without images a blank image, masked out of attention and loss
    (:mod:`dflop_ds.hf_trainer.guard`), before ms-swift prepares the batch (it derives the positions
    whose logits it keeps from the labels there): under ZeRO-3 a rank that skips the
    vision tower while another runs it waits forever in the tower's parameter gathers (seen here:
    a 2-rank run hung at its third step). Every family with a blank image in the registry is guarded;
    a microbatch that already carries visual input (ms-swift's Qwen2-VL template may add its own
    dummy image) is left as it is. Unlike the Trainer's guard under ZeRO-3, no blank video is paired
    with the images: ms-swift's Qwen2-VL and Qwen3-VL templates run the tower once on a microbatch's
    images and videos together (``pixel_values_mixed``), and its LLaVA-OneVision template encodes
    no videos (ms-swift 4.6.0)."""
    blank = blank_image_for(getattr(trainer.model, "config", None))
    if blank is None:
        return
    prepare = trainer._prepare_inputs

    def prepare_inputs(inputs: Any) -> Any:
        return prepare(guarded_batch(trainer.model, inputs, blank))

    trainer._prepare_inputs = prepare_inputs


def training_rows(dataset: Any) -> Any:
    """The rows behind ms-swift's training dataset (its ``LazyLLMDataset``'s Hugging Face dataset),
    with one fetch per index; a packed or streamed dataset is refused by its option."""
    kind = type(dataset).__name__
    if kind in ("PackingDataset", "IterablePackingDataset"):
        raise ValueError(
            "--callbacks dflop: --packing packs rows offline, before DFLOP sees them (each row several samples, fixed):"
            " drop --packing and pass --padding_free true, whose microbatches DFLOP balances by their packed cost"
        )
    if not hasattr(dataset, "__len__"):
        raise ValueError("--callbacks dflop: a streamed dataset (--streaming) has no index: drop --streaming")
    rows = getattr(dataset, "dataset", dataset)
    if getattr(dataset, "n_try_fetch", 1) > 1:
        logger.info("dflop: a row the template refuses stops training (ms-swift would train another in its place)")
        dataset.n_try_fetch = 1
    columns = [c for c in ("messages", "images", "videos", "audios") if c in getattr(rows, "column_names", ())]
    return rows.select_columns(columns) if columns else rows


class DFLOPSwiftCallback(TrainerCallback):
    """``--callbacks dflop``: built by ms-swift as ``DFLOPSwiftCallback(args, trainer)``; replaces
    the trainer's training loader with DFLOP's balanced microbatches."""

    def __init__(self, args: Any, trainer: Any) -> None:
        self.args = args
        self.trainer = trainer
        self.settings = run_settings(None, args.deepspeed, "--deepspeed")
        refuse_model_options(self.settings.config, "--deepspeed")
        self.batch_sampler: Any = None
        self.shape_policy: Any = None
        self._guarded = False
        self._resume: str | None = None
        trainer.get_train_dataloader = self.train_dataloader
        self._log, self._train, self._save = trainer.log, trainer.train, trainer._save_checkpoint
        trainer.log, trainer.train, trainer._save_checkpoint = self.log, self.train, self.save_checkpoint

    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        """ms-swift's ``trainer.train``; a resumed run checks the checkpoint's sampler state when
        the loader is built (as ``DFLOPTrainer`` does)."""
        self._resume = resumed_checkpoint(resume_from_checkpoint, self.args.output_dir)
        return self._train(resume_from_checkpoint, *args, **kwargs)

    def save_checkpoint(self, model: Any, trial: Any, *args: Any, **kwargs: Any) -> Any:
        """ms-swift's checkpoint, the sampler state written into its folder first (as
        ``DFLOPTrainer`` does): every checkpoint the Trainer can resume holds it."""
        save_before_checkpoint(self.trainer, trial, self.batch_sampler, self.shape_policy)
        return self._save(model, trial, *args, **kwargs)

    def train_dataloader(self, skip_batches: int = 0) -> Any:
        """This rank's loader of DFLOP microbatches over ms-swift's training dataset and collator."""
        if skip_batches:
            raise RuntimeError("--callbacks dflop: the Trainer skips a resumed epoch's microbatches itself")
        trainer, args = self.trainer, self.args
        refuse_unsupported(args, trainer)
        dataset = trainer.train_dataset
        if dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        rows = training_rows(dataset)
        model_dir = trainer.model_info.model_dir
        policy = hf_preprocessor(model_dir).policy()
        shapes = chat_shapes(rows, policy, f"ms-swift's training dataset ({model_dir})")
        config = self.settings.config
        seed, seed_source = self.settings.seed(args.data_seed, args.seed)
        padding_free = bool(getattr(trainer.template, "padding_free", False))
        row_attention = padding_free and not attends_per_sample(trainer.model)
        cost_model = resolve_cost_model(config, policy, trainer.model, padding_free, row_attention)
        topology = TrainerTopology.of_trainer(trainer)
        batch_sampler = build_trainer_sampler(
            RunInputs(config, shapes, cost_model, seed, seed_source, self.settings.sync), topology
        )
        if self._resume is not None:
            check_resume_state(self._resume, batch_sampler, policy)
        self.batch_sampler, self.shape_policy = batch_sampler, policy
        if not self._guarded:
            guard_image_free_microbatches(trainer)
            self._guarded = True
        return train_loader(dataset, self.batch_sampler, trainer.data_collator, args)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """ms-swift's log, with the scheduler's telemetry since the last training log
        (``dflop_predicted_imbalance``, ``dflop_predicted_step_over_bound``, ``dflop_predicted_step_s``,
        ``dflop_schedule_s``)."""
        if "loss" in logs and self.batch_sampler is not None:
            logs = {**logs, **self.batch_sampler.log.drain()}
        self._log(logs, *args, **kwargs)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Stop the sampler's background scheduling (training may end mid-epoch)."""
        if self.batch_sampler is not None:
            self.batch_sampler.close()


__all__ = [
    "CALLBACK",
    "SWIFT_INSTEAD",
    "DFLOPSwiftCallback",
    "refuse_model_options",
    "refuse_unsupported",
    "register",
    "training_rows",
]
