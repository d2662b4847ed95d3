"""The one function every entry point builds its sampler with (:mod:`dflop_ds.compose`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from dflop_ds.config import DFLOPConfig
from dflop_ds.cost import CostModel
from dflop_ds.schedule import make_sampler
from dflop_ds.schedule.batch_schedule import CostAdjuster
from dflop_ds.schedule.global_sampler import GlobalBatchSampler
from dflop_ds.schedule.sampler import SamplerSettings
from dflop_ds.shapes import SampleShape
from dflop_ds.sync import SyncModel


def sampler_settings(cfg: DFLOPConfig) -> SamplerSettings:
    """The sampler's settings of the ``"dflop"`` block: the one place they are read from it."""
    return SamplerSettings(
        method=cfg.sampler.kind,
        seed=cfg.train.seed,
        prefetch=cfg.sampler.prefetch,
        time_limit_s=cfg.sampler.time_limit_s,
        ilp_nodes=cfg.sampler.ilp_nodes,
        drop_last=cfg.sampler.drop_last,
        schedule_timeout_s=cfg.sampler.schedule_timeout_s,
        allow_oversize=cfg.sampler.allow_oversize,
    )


def schedule_sampler(
    settings: DFLOPConfig,
    shapes: Sequence[SampleShape],
    *,
    global_batch_size: int,
    gradient_accumulation_steps: int,
    dp_rank: int,
    dp_size: int,
    cost_model: CostModel | None,
    sync: SyncModel,
    memory_cap: float | None,
    seed: int | None = None,
    drop_last: bool | None = None,
    label_tokens_fn: Callable[[SampleShape], int] | None = None,
    cost_adjuster: CostAdjuster | None = None,
) -> GlobalBatchSampler:
    """Data-parallel rank ``dp_rank``'s sampler of ``shapes`` as ``settings``' ``dflop.sampler``
    section chooses (:func:`~dflop_ds.schedule.make_sampler`): the one place every entry point
    builds it. ``seed`` and ``drop_last``, when given, replace the block's (a Trainer's seed may
    come from its ``TrainingArguments``, and ``TrainerBatchSampler`` cuts its epochs itself)."""
    chosen = sampler_settings(settings)
    if seed is not None:
        chosen = dataclasses.replace(chosen, seed=seed)
    if drop_last is not None:
        chosen = dataclasses.replace(chosen, drop_last=drop_last)
    return make_sampler(
        chosen,
        shapes,
        global_batch_size=global_batch_size,
        gradient_accumulation_steps=gradient_accumulation_steps,
        dp_rank=dp_rank,
        dp_size=dp_size,
        cost_model=cost_model,
        label_tokens_fn=label_tokens_fn,
        cost_adjuster=cost_adjuster,
        sync=sync,
        memory_cap=memory_cap,
    )
