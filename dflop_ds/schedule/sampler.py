"""The samplers a run builds from its config: :class:`SamplerSettings` and :func:`make_sampler`, the
registered-splitter samplers, and (re-exported) the sampler core
(:mod:`dflop_ds.schedule.global_sampler`) and DFLOP's sampler (:mod:`dflop_ds.schedule.dflop_sampler`).

Every global batch holds exactly ``global_batch_size`` samples drawn from seeded per-epoch
permutations (:mod:`dflop_ds.schedule.epoch`: the remainder of an epoch is carried into the next,
or dropped and counted with ``drop_last``) and is split into exactly
``gradient_accumulation_steps`` microbatches for each data-parallel rank. The split is a pure
function of ``(seed, epoch, batch)``: the first and last pipeline stages of a rank, which both
read the data iterator, and all other ranks compute the same schedule without talking.

Use it in existing DeepSpeed code::

    sampler = DFLOPBatchSampler(shapes, global_batch_size=64,
                                gradient_accumulation_steps=engine.gradient_accumulation_steps(),
                                dp_rank=engine.grid.get_data_parallel_rank(),
                                dp_size=engine.grid.get_data_parallel_world_size(),
                                cost_model=cost_model)
    loader = dflop_ds.make_loader(dataset, sampler, collate_fn=collate, num_workers=2)
    data_iter = iter(deepspeed.utils.RepeatingLoader(loader))
    engine.train_batch(data_iter)

``make_loader`` keeps the sampler's position at what the caller consumed (DataLoader workers
fetch ahead), so ``sampler.state_dict()`` / ``loader.state_dict()`` resume exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dflop_ds.cost import CostModel
from dflop_ds.schedule.batch_schedule import SCHEDULE_TIMEOUT_S, BatchSchedule, CostAdjuster
from dflop_ds.schedule.dflop_sampler import DFLOPBatchSampler
from dflop_ds.schedule.global_sampler import GlobalBatchSampler
from dflop_ds.schedule.memory import oversize_samples
from dflop_ds.schedule.splitters import SplitResult, make_splitter, splitter_names
from dflop_ds.shapes import SampleShape
from dflop_ds.sync import SyncModel

__all__ = [
    "SCHEDULE_TIMEOUT_S",
    "BatchSchedule",
    "CostAdjuster",
    "DFLOPBatchSampler",
    "GlobalBatchSampler",
    "SamplerSettings",
    "SplitterSampler",
    "StockBatchSampler",
    "make_sampler",
]


class SplitterSampler(GlobalBatchSampler):
    """A sampler whose global batches are cut by the registered splitter named ``splitter``
    (:func:`~dflop_ds.schedule.splitters.make_splitter`), e.g. ``"llava"`` or ``"verl"``. Under a
    ``memory_cap`` these splitters cut as their users run them, whatever the memory: a sample
    over the cap alone is refused here, and a split with a microbatch over it is an
    :class:`~dflop_ds.schedule.splitters.OverBudgetError` naming it when its batch is scheduled."""

    def __init__(self, shapes: Sequence[SampleShape], *, splitter: str, **kwargs) -> None:
        self.splitter = make_splitter(splitter)
        self.method = splitter
        super().__init__(shapes, **kwargs)
        if self.memory is not None and self.memory_cap is not None:
            oversize_samples(self.shapes, self.memory, self.memory_cap, allow_oversize=False)

    def split(self, batch: np.ndarray, costs: np.ndarray, batch_seed: int) -> SplitResult:
        """The splitter's split of ``batch``."""
        return self.splitter.split(self.split_request(batch, costs, batch_seed))


class StockBatchSampler(SplitterSampler):
    """Stock DeepSpeed behaviour: random order, fixed sample count per microbatch."""

    method = "stock"

    def __init__(self, shapes: Sequence[SampleShape], **kwargs) -> None:
        super().__init__(shapes, splitter="stock", **kwargs)


@dataclass(frozen=True)
class SamplerSettings:
    """The sampler's settings from the config (``dflop.sampler`` and ``dflop.train.seed``;
    :func:`dflop_ds.compose.sampler.sampler_settings` builds them): ``method`` is a registered
    splitter; ``time_limit_s``, ``ilp_nodes`` and ``allow_oversize`` are ``"dflop"``'s alone.
    See :class:`GlobalBatchSampler` and :class:`DFLOPBatchSampler` for the others."""

    method: str = "dflop"
    seed: int = 0
    prefetch: int = 1
    time_limit_s: float = 0.0
    ilp_nodes: int = 0
    drop_last: bool = False
    schedule_timeout_s: float | None = SCHEDULE_TIMEOUT_S
    allow_oversize: bool = False


def make_sampler(
    settings: SamplerSettings,
    shapes: Sequence[SampleShape],
    *,
    global_batch_size: int,
    gradient_accumulation_steps: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    cost_model: CostModel | None = None,
    label_tokens_fn: Callable[[SampleShape], int] | None = None,
    cost_adjuster: CostAdjuster | None = None,
    sync: SyncModel | str = SyncModel.PIPELINE,
    memory_cap: float | None = None,
) -> GlobalBatchSampler:
    """Build the sampler splitting with the registered splitter ``settings.method`` (``"dflop"``,
    ``"stock"``, ``"llava"``, ``"verl"``, ...) for this run's batch sizes, rank, cost model and
    sync model (:func:`~dflop_ds.sync.sync_model_of` of the engine's config); the exact-solver
    and oversize options go to ``"dflop"`` alone."""
    method = settings.method
    if method not in splitter_names():
        raise ValueError(f"unknown sampler {method!r}: choose one of {list(splitter_names())}")
    common: dict[str, Any] = {
        "global_batch_size": global_batch_size,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        "dp_rank": dp_rank,
        "dp_size": dp_size,
        "cost_model": cost_model,
        "seed": settings.seed,
        "prefetch": settings.prefetch,
        "label_tokens_fn": label_tokens_fn,
        "cost_adjuster": cost_adjuster,
        "drop_last": settings.drop_last,
        "schedule_timeout_s": settings.schedule_timeout_s,
        "memory_cap": memory_cap,
        "sync": sync,
    }
    if method == "dflop":
        return DFLOPBatchSampler(
            shapes,
            time_limit_s=settings.time_limit_s,
            ilp_nodes=settings.ilp_nodes,
            allow_oversize=settings.allow_oversize,
            **common,
        )
    if method == "stock":
        return StockBatchSampler(shapes, **common)
    return SplitterSampler(shapes, splitter=method, **common)
