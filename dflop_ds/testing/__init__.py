"""Test helpers that run inside real training (fault injection)."""

from dflop_ds.testing.faults import FaultSpec, SlowTiles

__all__ = ["FaultSpec", "SlowTiles"]
