"""Splitters: the ways of cutting a global batch into per-rank microbatches, registered by name.

``make_splitter(name, **options).split(SplitRequest(...)) -> SplitResult``. The sampler, the
planner's evaluation and the benchmarks share these, so a baseline is measured and planned the
same way. A new splitter is one module in this package whose class is decorated with
:func:`register_splitter`, imported below: importing it registers it, with the package.
"""

from dflop_ds.schedule.splitters.base import (
    MemoryBudget,
    MicrobatchCost,
    MicrobatchMemory,
    OverBudgetError,
    RankSplit,
    SplitRequest,
    SplitResult,
    Splitter,
    check_split,
    make_splitter,
    register_splitter,
    splitter_names,
)
from dflop_ds.schedule.splitters.batch_rebalance import BatchRebalanceSplitter
from dflop_ds.schedule.splitters.dflop import FALLBACK_SUFFIX, DFLOPSplitter
from dflop_ds.schedule.splitters.llamafactory import LlamaFactoryPackingSplitter
from dflop_ds.schedule.splitters.llava import LlavaSplitter
from dflop_ds.schedule.splitters.stock import StockSplitter
from dflop_ds.schedule.splitters.swift import SwiftPackingSplitter
from dflop_ds.schedule.splitters.verl import VerlSplitter

__all__ = [
    "BatchRebalanceSplitter",
    "DFLOPSplitter",
    "FALLBACK_SUFFIX",
    "LlamaFactoryPackingSplitter",
    "LlavaSplitter",
    "MemoryBudget",
    "MicrobatchCost",
    "MicrobatchMemory",
    "OverBudgetError",
    "RankSplit",
    "SplitRequest",
    "SplitResult",
    "Splitter",
    "StockSplitter",
    "SwiftPackingSplitter",
    "VerlSplitter",
    "check_split",
    "make_splitter",
    "register_splitter",
    "splitter_names",
]
