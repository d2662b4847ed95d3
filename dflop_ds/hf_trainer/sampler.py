"""The DFLOP batch sampler as a ``transformers.Trainer`` iterates it.

The Trainer counts epochs of ``len(dataloader)`` microbatches and calls ``set_epoch`` before each.
A dflop-ds sampler is one stream of global batches (an epoch's remainder is carried into the next
epoch, so epochs differ by a batch). :class:`TrainerBatchSampler` cuts that stream into windows of
a fixed number of global batches: Trainer epoch ``w`` is global batches ``[w * window, (w + 1) *
window)`` of the stream, this rank's ``gradient_accumulation_steps`` microbatches of each. Where a
window starts is a pure function of ``w``, so the Trainer's own resume (its epoch, then skipping
the microbatches already trained) lands on the next untrained microbatch, and over the run every
sample of the stream is trained exactly once.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torch.utils.data import DataLoader, Sampler

from dflop_ds.schedule.epoch import first_batch
from dflop_ds.schedule.index import ScheduledIndex
from dflop_ds.schedule.sampler import BatchSchedule, GlobalBatchSampler
from dflop_ds.schedule.state import Position


def data_parallel_coords(process_index: int, world_size: int, tp_size: int) -> tuple[int, int]:
    """``(dp_rank, dp_size)`` of a process when ranks form a ``(data, tensor)`` mesh, tensor-parallel
    peers adjacent (DeepSpeed AutoTP's and Accelerate's layout): the peers of a tensor-parallel
    group share one data-parallel rank, so they get identical microbatches."""
    if tp_size < 1 or world_size % tp_size:
        raise ValueError(f"the world size {world_size} is not a multiple of the tensor-parallel size {tp_size}")
    return process_index // tp_size, world_size // tp_size


def stream_position(global_batch: int, n_samples: int, global_batch_size: int, drop_last: bool) -> Position:
    """The sampler position of global batch ``global_batch`` counted over the run (its epoch and
    its index within that epoch)."""
    epoch = global_batch * global_batch_size // max(n_samples, 1)
    while epoch > 0 and first_batch(epoch, n_samples, global_batch_size, drop_last) > global_batch:
        epoch -= 1
    while first_batch(epoch + 1, n_samples, global_batch_size, drop_last) <= global_batch:
        epoch += 1
    return Position(epoch, global_batch - first_batch(epoch, n_samples, global_batch_size, drop_last), 0)


@dataclass
class ScheduleLog:
    """The schedules a rank has drawn microbatches from since the last :meth:`drain`."""

    imbalance: list[float] = field(default_factory=list)
    schedule_s: list[float] = field(default_factory=list)

    def add(self, schedule: BatchSchedule) -> None:
        """Record one global batch's schedule."""
        self.imbalance.append(float(np.max(schedule.imbalance())))
        self.schedule_s.append(float(schedule.schedule_s))

    def drain(self) -> dict[str, float]:
        """Mean predicted imbalance (slowest / mean microbatch) and total scheduler seconds of the
        schedules since the last call, as Trainer log entries (empty when there were none)."""
        if not self.imbalance:
            return {}
        logs = {
            "dflop_predicted_imbalance": float(np.mean(self.imbalance)),
            "dflop_schedule_s": float(np.sum(self.schedule_s)),
        }
        self.imbalance.clear()
        self.schedule_s.clear()
        return logs


class TrainerBatchSampler(Sampler[list[ScheduledIndex]]):
    """A dflop-ds sampler in fixed windows of global batches, one window per Trainer epoch.

    Args:
        sampler: the dflop-ds sampler (its ``dp_rank`` is this process's data-parallel rank).
        window: global batches per Trainer epoch (default: the sampler's first epoch's, i.e.
            ``len(dataset) // global_batch_size``).
    """

    def __init__(self, sampler: GlobalBatchSampler, window: int | None = None) -> None:
        self.sampler = sampler
        self.window = int(sampler.n_batches(0) if window is None else window)
        if self.window < 1:
            raise ValueError(f"a Trainer epoch needs at least one global batch, got window={self.window}")
        self.epoch = 0
        self.log = ScheduleLog()

    def set_epoch(self, epoch: int) -> None:
        """Start Trainer epoch ``epoch`` at the next iteration."""
        self.epoch = int(epoch)

    def __len__(self) -> int:
        """Microbatches this rank yields per Trainer epoch."""
        return self.window * self.sampler.n_mb

    def position_of(self, global_batch: int) -> Position:
        """The sampler position of global batch ``global_batch`` of the run."""
        sampler = self.sampler
        return stream_position(global_batch, len(sampler.shapes), sampler.global_batch_size, sampler.drop_last)

    def __iter__(self) -> Iterator[list[ScheduledIndex]]:
        """This rank's microbatches of the current Trainer epoch, in training order."""
        self.sampler.position = self.position_of(self.epoch * self.window)
        produced, wanted = 0, len(self)
        last: BatchSchedule | None = None
        while produced < wanted:
            stream = self.sampler.scheduled_microbatches()
            try:
                for position, schedule, indices in stream:
                    self.sampler.consumed(position, schedule)
                    if schedule is not last:
                        self.log.add(schedule)
                        last = schedule
                    yield indices
                    produced += 1
                    if produced == wanted:
                        break
            finally:
                getattr(stream, "close", lambda: None)()  # stop its background scheduling


class TrainerDataLoader(DataLoader):
    """A ``DataLoader`` over a :class:`TrainerBatchSampler` that passes ``set_epoch`` on (the
    Trainer calls it on the loader before every epoch)."""

    batch_sampler: Any

    def set_epoch(self, epoch: int) -> None:
        """Start Trainer epoch ``epoch``."""
        self.batch_sampler.set_epoch(epoch)


__all__ = [
    "ScheduleLog",
    "TrainerBatchSampler",
    "TrainerDataLoader",
    "data_parallel_coords",
    "stream_position",
]
