"""Test helpers that inject faults into real components: slow shapes, stuck schedulers."""

from dflop_ds.testing.faults import FaultSpec, SlowTiles
from dflop_ds.testing.scheduler import StuckSplitSampler

__all__ = ["FaultSpec", "SlowTiles", "StuckSplitSampler"]
