"""Scheduler faults for tests: a batch split or an exact solve that blocks until released."""

from __future__ import annotations

import threading

import numpy as np

from dflop_ds.schedule.sampler import DFLOPBatchSampler
from dflop_ds.schedule.splitters import SplitResult


class StuckSplitSampler(DFLOPBatchSampler):
    """A :class:`DFLOPBatchSampler` whose split of global batch ``stuck_batch`` (of any epoch)
    blocks until ``release`` is set, like a partitioner that hangs on one rank.

    ``stuck_exact=True`` blocks only the exact solver of every batch (an ILP that overruns),
    leaving the heuristic fallback free.
    """

    def __init__(self, shapes, *, stuck_batch: int = -1, stuck_exact: bool = False, **kwargs) -> None:
        self.stuck_batch = int(stuck_batch)
        self.stuck_exact = bool(stuck_exact)
        self.release = threading.Event()
        super().__init__(shapes, **kwargs)

    def schedule(self, epoch: int, batch_id: int, batch: np.ndarray):
        """The schedule, after blocking on ``release`` when ``batch_id`` is the stuck batch."""
        if batch_id == self.stuck_batch:
            self.release.wait()
        return super().schedule(epoch, batch_id, batch)

    def balanced_split(self, batch: np.ndarray, costs: np.ndarray, batch_seed: int, exact: bool) -> SplitResult:
        """The split, blocked on ``release`` first when it is exact and ``stuck_exact`` is set."""
        if exact and self.stuck_exact:
            self.release.wait()
        return super().balanced_split(batch, costs, batch_seed, exact)
