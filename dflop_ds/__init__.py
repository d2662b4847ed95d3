"""dflop-ds: data-aware multimodal LLM training on stock DeepSpeed (DFLOP, arXiv 2603.25120)."""

from dflop_ds.loader import make_loader
from dflop_ds.schedule import DFLOPBatchSampler, StockBatchSampler, assign_to_ranks, partition_batch
from dflop_ds.shapes import TINY_POLICY, SampleShape, ShapePolicy

__version__ = "0.1.0"

__all__ = [
    "DFLOPBatchSampler",
    "SampleShape",
    "ShapePolicy",
    "StockBatchSampler",
    "TINY_POLICY",
    "__version__",
    "assign_to_ranks",
    "make_loader",
    "partition_batch",
]
