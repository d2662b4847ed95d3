"""Test helpers: tiny models and data built offline, a stuck scheduler. Production code never
imports this package (the layer test checks it); fault injection itself is :mod:`dflop_ds.models.faults`."""

from dflop_ds.testing.scheduler import StuckSplitSampler

__all__ = ["StuckSplitSampler"]
