"""What one global batch's schedule is, and how observed costs may adjust it before the split."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from dflop_ds.schedule.splitters import SplitResult
from dflop_ds.shapes import SampleShape

#: Default ``schedule_timeout_s``: how long the training loop waits for one batch's schedule.
SCHEDULE_TIMEOUT_S = 300.0


class CostAdjuster(Protocol):
    """Adjusts predicted costs from what training observed (e.g. adaptive correction).

    ``adjust(version, costs, shapes)`` returns the costs to schedule with, using the adjuster's
    state as of ``version`` (the number of completed training steps it reflects); it may block
    until that version exists. Every rank must hold the same state per version, so schedules
    stay identical.
    """

    #: True when the adjusted costs are in other columns than the cost model's (e.g. seconds per
    #: pipeline stage): a microbatch then costs the sum of its samples' adjusted costs. False: the
    #: same columns, and a collated microbatch's predicted cost is scaled by its samples' adjustment.
    replaces_columns: bool

    def adjust(self, version: int, costs: np.ndarray, shapes: Sequence[SampleShape]) -> np.ndarray: ...


@dataclass(frozen=True)
class BatchSchedule:
    """The schedule of one global batch, identical on every rank.

    Attributes:
        epoch, batch_id: which batch of which epoch.
        split: the per-rank microbatches with their predicted costs.
        loss_denominator: label tokens of the batch / (gradient_accumulation_steps * dp).
        label_tokens: label tokens of the whole batch.
        schedule_s: wall time spent computing the split.
    """

    epoch: int
    batch_id: int
    split: SplitResult
    loss_denominator: float
    label_tokens: int
    schedule_s: float

    @property
    def n_samples(self) -> int:
        """Samples in the global batch."""
        return sum(len(mb) for rank in self.split.ranks for mb in rank)

    def step_over_bound(self) -> float | None:
        """The predicted step under the run's sync model over the lower bound of any split of this
        batch (1.0: no split could be faster; the bound knows a sample cannot be split; under a
        pipeline, the slowest microbatch over its bound); None when the splitter computed no bound."""
        split = self.split
        if split.lower_bound <= 0 or split.step <= 0:
            return None
        return float(split.step / split.lower_bound)

    def imbalance(self) -> np.ndarray:
        """Predicted max / mean microbatch cost, per cost column (1.0 is perfect balance). Under a
        sync model where ranks meet per microbatch or per module, microbatches of one rank may
        differ on purpose (heavy ones aligned across ranks): :meth:`step_over_bound` is the measure
        of the split there."""
        costs = self.split.predicted.reshape(-1, self.split.predicted.shape[-1])
        mean = costs.mean(axis=0)
        return np.divide(costs.max(axis=0), mean, out=np.ones_like(mean), where=mean > 0)
