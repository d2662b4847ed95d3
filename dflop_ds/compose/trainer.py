"""The Trainer-shaped entry points' half of the composition root (:mod:`dflop_ds.compose`): the
``"dflop"`` block, the cost model, the cross-rank agreement and the
:class:`~dflop_ds.hf_trainer.sampler.TrainerBatchSampler` for a :class:`TrainerTopology`."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from dflop_ds.compose.sampler import schedule_sampler
from dflop_ds.config import AUTO, OFF, DFLOPConfig
from dflop_ds.cost import CostModel, PackedCost, load_cost_model, sampler_cost_model
from dflop_ds.hf_trainer.agreement import check_ranks_agree, model_depths, trainer_input_digests
from dflop_ds.hf_trainer.block_rules import check_trainer_block
from dflop_ds.hf_trainer.sampler import (
    TrainerBatchSampler,
    TrainerDataLoader,
    last_step_microbatches,
    trainer_data_parallel_coords,
)
from dflop_ds.jsonio import read_json_object
from dflop_ds.setup_checks import check_cost_model_fits, check_time_limit
from dflop_ds.shapes import SampleShape, ShapePolicy
from dflop_ds.sync import SyncModel, sync_model_of

#: what the cost source is called in messages when the block names no cost model
PROXY = "the unitless proxy"


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


@dataclass(frozen=True)
class RunSettings:
    """The typed ``"dflop"`` block of a run, ``seed_source`` when the block sets ``train.seed``, and
    how the ranks meet (``sync``: no pipeline under a Trainer, so the DeepSpeed config's ZeRO stage decides)."""

    config: DFLOPConfig
    seed_source: str | None
    sync: SyncModel

    def seed(self, data_seed: int | None, seed: int) -> tuple[int, str]:
        """``(seed, where it came from)`` of the data order: ``dflop.train.seed`` when the block
        sets it (0 included), else the Trainer's ``data_seed`` or ``seed``."""
        if self.seed_source is not None:
            return self.config.train.seed, self.seed_source
        if data_seed is not None:
            return int(data_seed), "TrainingArguments.data_seed"
        return int(seed), "TrainingArguments.seed"


def run_settings(
    dflop: Mapping[str, Any] | None, deepspeed: Any, deepspeed_source: str = "TrainingArguments.deepspeed"
) -> RunSettings:
    """The :class:`RunSettings` of :func:`dflop_block`'s block; a bad block is a ``ValueError``
    naming the key and the config it came from."""
    block, source = dflop_block(dflop, deepspeed, deepspeed_source)
    config = DFLOPConfig.from_dict(block, source=source)
    ds_config = deepspeed if isinstance(deepspeed, Mapping) else read_json_object(deepspeed) if deepspeed else {}
    return RunSettings(config, f"{source}: train.seed" if block_sets_seed(block) else None, sync_model_of(ds_config))


def memory_cap(settings: DFLOPConfig) -> float | None:
    """``dflop.sampler.memory_cap_bytes`` as the sampler takes it: a number, or None for ``"off"``
    and the default ``"auto"`` left unset (the Trainer runs no plan and measures no device budget,
    so a block that sets ``"auto"`` is refused by :func:`dflop_block`)."""
    cap = settings.sampler.memory_cap_bytes
    return None if cap in (AUTO, OFF) else float(cap)


def epochs_to_train(args: Any, batches_per_epoch: int) -> int:
    """The epochs a Trainer run with ``args`` (``TrainingArguments``, or anything with its
    ``max_steps`` and ``num_train_epochs``) reaches: those ``max_steps`` optimizer steps span when
    set (one step per global batch), else ``num_train_epochs`` rounded up."""
    if args.max_steps is not None and args.max_steps > 0:
        return max(1, math.ceil(args.max_steps / max(1, batches_per_epoch)))
    return max(1, math.ceil(args.num_train_epochs))


def attends_per_sample(model: Any) -> bool:
    """Whether ``model``'s HF attention keeps the samples of a padding-free row apart at the cost of
    each sample's own length: a flash-attention implementation (variable-length kernels from the
    position ids, transformers' ``is_flash_attention_requested``, as
    :func:`dflop_ds.models.hf.base.packed.packed_attention` asks it). SDPA and eager run the row's
    block-diagonal mask as one dense product."""
    from transformers.utils.generic import is_flash_attention_requested

    config = getattr(model, "config", None)
    if config is None:
        return False
    get_text_config = getattr(config, "get_text_config", None)
    return is_flash_attention_requested(config if get_text_config is None else get_text_config())


def resolve_cost_model(
    settings: DFLOPConfig,
    policy: ShapePolicy | None,
    model: Any,
    padding_free: bool = False,
    row_attention: bool = False,
) -> CostModel | None:
    """The cost model ``dflop.sampler.cost_model`` names (None: the proxy), checked against the
    shapes' ``policy`` (when known) and ``model``'s depth (LLaVA, Qwen2-VL); with
    ``dflop.model.packing=true`` or ``padding_free`` (the framework packs each microbatch itself)
    wrapped for padding-free microbatches, whose attention spans the whole row when
    ``row_attention`` (:class:`~dflop_ds.cost.RowPackedCost`)."""
    path = settings.sampler.cost_model
    packed = bool(settings.model.packing) or padding_free
    if path is None:
        return sampler_cost_model(None, packed=True, row_attention=row_attention) if packed else None
    cost_model = load_cost_model(path)
    if packed and isinstance(cost_model, PackedCost):
        raise ValueError(
            f"{path}: this cost model is already packed and padding-free microbatches pack it again:"
            " name the profiled (unpacked) cost model"
        )
    depths = model_depths(model)
    check_cost_model_fits(
        cost_model,
        policy,
        encoder_layers=None if depths is None else depths[0],
        llm_layers=None if depths is None else depths[1],
        source=str(path),
    )
    return sampler_cost_model(cost_model, packed=packed, row_attention=row_attention)


@dataclass(frozen=True)
class TrainerTopology:
    """Where a Trainer process sits and how its batches are counted: ``process_index`` of
    ``world_size`` processes in a ``(data, tensor)`` mesh of ``tp_size`` peers,
    ``per_device_batch`` samples x ``gradient_accumulation_steps`` microbatches per step; and how
    long it trains: ``max_steps`` optimizer steps when above 0, else ``num_train_epochs``."""

    process_index: int
    world_size: int
    tp_size: int
    per_device_batch: int
    gradient_accumulation_steps: int
    drop_last: bool
    max_steps: int = -1
    num_train_epochs: float = 1.0

    @classmethod
    def of_trainer(cls, trainer: Any) -> TrainerTopology:
        """The topology of a ``transformers.Trainer`` (its ``TrainingArguments`` and tensor-parallel size)."""
        args = trainer.args
        return cls(
            process_index=args.process_index,
            world_size=max(1, args.world_size),
            tp_size=trainer.get_tp_size(),
            per_device_batch=args.per_device_train_batch_size,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            drop_last=args.dataloader_drop_last,
            max_steps=args.max_steps if args.max_steps is not None else -1,
            num_train_epochs=args.num_train_epochs,
        )

    def epochs(self, batches_per_epoch: int) -> int:
        """The epochs the run reaches (:func:`epochs_to_train` of this topology's run length)."""
        return epochs_to_train(self, batches_per_epoch)

    @property
    def data_parallel(self) -> tuple[int, int]:
        """``(dp_rank, dp_size)``: tensor-parallel peers share a data-parallel rank."""
        return trainer_data_parallel_coords(self.process_index, self.world_size, self.tp_size)

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over every data-parallel rank."""
        return self.per_device_batch * self.gradient_accumulation_steps * self.data_parallel[1]


def train_loader(dataset: Any, batch_sampler: TrainerBatchSampler, collate_fn: Any, args: Any) -> TrainerDataLoader:
    """The training loader of a Trainer (``args``: its ``TrainingArguments``): ``collate_fn`` over
    ``batch_sampler``'s microbatches, with the arguments' worker settings, never passed through
    ``accelerator.prepare`` (which would shard and pad the microbatches again)."""
    from transformers.trainer_utils import seed_worker

    workers = args.dataloader_num_workers
    return TrainerDataLoader(
        dataset,
        batch_sampler=batch_sampler,
        collate_fn=collate_fn,
        num_workers=workers,
        pin_memory=args.dataloader_pin_memory,
        persistent_workers=args.dataloader_persistent_workers and workers > 0,
        prefetch_factor=args.dataloader_prefetch_factor if workers > 0 else None,
        worker_init_fn=partial(seed_worker, num_workers=workers, rank=args.process_index),
    )


@dataclass(frozen=True)
class RunInputs:
    """What every rank's split is computed from: the settings, one shape per dataset index, the
    cost model (None: the proxy), the data order's seed with where it came from, and how the ranks
    meet (the sync model the split minimises the step under)."""

    settings: DFLOPConfig
    shapes: Sequence[SampleShape]
    cost_model: CostModel | None
    seed: int
    seed_source: str
    sync: SyncModel


def build_trainer_sampler(inputs: RunInputs, topology: TrainerTopology) -> TrainerBatchSampler:
    """This rank's :class:`~dflop_ds.hf_trainer.sampler.TrainerBatchSampler`, once every rank
    agrees on ``inputs`` and the batch settings (a collective: every rank calls it). A
    time-limited solver is refused with more than one rank (each rank solves alone); under a
    memory cap, every global batch of the epochs the run reaches is fitted now, so a batch the cap
    cannot split is an error before step 0 (:class:`~dflop_ds.schedule.MemoryCapError`), not when
    training gets there."""
    settings, shapes = inputs.settings, list(inputs.shapes)
    dp_rank, dp_size = topology.data_parallel
    check_time_limit(settings, topology.world_size)
    gas, global_batch = topology.gradient_accumulation_steps, topology.global_batch
    cap = memory_cap(settings)
    options: dict[str, Any] = {"memory_cap": cap, "allow_oversize": settings.sampler.allow_oversize} if cap else {}
    drop_last = settings.sampler.drop_last or topology.drop_last
    digested_settings = {
        "kind": settings.sampler.kind,
        "global_batch_size": global_batch,
        "gradient_accumulation_steps": gas,
        "dp_size": dp_size,
        "drop_last": drop_last,
        "ilp_nodes": settings.sampler.ilp_nodes,
        "sync": inputs.sync.value,
        **options,
    }
    check_ranks_agree(
        trainer_input_digests(
            shapes,
            inputs.cost_model,
            settings.sampler.cost_model or PROXY,
            inputs.seed,
            inputs.seed_source,
            digested_settings,
            topology.process_index,
        )
    )
    build = partial(
        schedule_sampler,
        settings,
        shapes,
        dp_rank=dp_rank,
        dp_size=dp_size,
        cost_model=inputs.cost_model,
        sync=inputs.sync,
        memory_cap=cap,
        seed=inputs.seed,
        drop_last=False,  # epochs are cut by TrainerBatchSampler
    )
    last_gas = last_step_microbatches(len(shapes), global_batch, gas, dp_size, drop_last)
    batch_sampler = TrainerBatchSampler(
        build(global_batch_size=global_batch, gradient_accumulation_steps=gas),
        drop_last=drop_last,
        last_step_sampler=None
        if last_gas == gas
        else build(global_batch_size=len(shapes) % global_batch, gradient_accumulation_steps=last_gas),
    )
    batch_sampler.check_epochs(topology.epochs(batch_sampler.batches_per_epoch))
    return batch_sampler


__all__ = [
    "PROXY",
    "RunInputs",
    "RunSettings",
    "TrainerTopology",
    "attends_per_sample",
    "block_sets_seed",
    "build_trainer_sampler",
    "dflop_block",
    "dflop_settings",
    "epochs_to_train",
    "memory_cap",
    "resolve_cost_model",
    "run_settings",
    "train_loader",
]
