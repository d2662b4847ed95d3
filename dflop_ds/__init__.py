"""dflop-ds: data-aware multimodal LLM training on stock DeepSpeed (DFLOP, arXiv 2603.25120)."""

from dflop_ds.shapes import SampleShape, ShapePolicy, TINY_POLICY

__version__ = "0.1.0"

__all__ = ["SampleShape", "ShapePolicy", "TINY_POLICY", "__version__"]
