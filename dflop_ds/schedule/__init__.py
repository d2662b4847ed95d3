"""dflop_ds.schedule: balanced microbatches: the partitioner, rank assignment and batch samplers."""

from dflop_ds.schedule.fit_batches import MemoryCapError
from dflop_ds.schedule.index import ScheduledIndex
from dflop_ds.schedule.partition import InfeasibleError, Partition, partition_batch
from dflop_ds.schedule.ranks import assign_to_ranks
from dflop_ds.schedule.sampler import (
    BatchSchedule,
    DFLOPBatchSampler,
    GlobalBatchSampler,
    SamplerSettings,
    SplitterSampler,
    StockBatchSampler,
    make_sampler,
)
from dflop_ds.schedule.splitters import SplitRequest, SplitResult, make_splitter, splitter_names

__all__ = [
    "BatchSchedule",
    "DFLOPBatchSampler",
    "GlobalBatchSampler",
    "InfeasibleError",
    "MemoryCapError",
    "Partition",
    "SamplerSettings",
    "ScheduledIndex",
    "SplitRequest",
    "SplitResult",
    "SplitterSampler",
    "StockBatchSampler",
    "assign_to_ranks",
    "make_sampler",
    "make_splitter",
    "partition_batch",
    "splitter_names",
]
