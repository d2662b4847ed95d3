"""The DFLOP batch sampler as a ``transformers.Trainer`` iterates it.

The Trainer counts epochs of ``len(dataloader)`` microbatches, calls ``set_epoch`` before each, and
on resume skips the microbatches of the current epoch it already trained. :class:`TrainerBatchSampler`
follows the Trainer's own epoch rule: epoch ``e`` is the seeded permutation of ``(seed, e)`` cut
into global batches of ``global_batch_size`` samples, and the last, shorter batch is trained too
(as the Trainer's loader keeps its last partial batch, unless ``dataloader_drop_last``). A short
batch that fills every microbatch of a step (``gradient_accumulation_steps x dp`` samples) is split
like the others; a smaller one is the epoch's last, shorter step: ``rest // dp`` microbatches per
rank, the same count on every rank, so ZeRO's reductions stay in step (the Trainer steps the
optimizer after an epoch's last microbatch, and its ``num_items_in_batch`` counts that step's
labels). Only fewer left-over samples than data-parallel ranks cannot give every rank a microbatch:
they are dropped for that epoch (a different few each epoch), with a warning that counts them.
Each global batch is split by the dflop-ds sampler's ``schedule`` (a pure function of epoch, batch
and samples), so every rank computes the same split alone, and each data-parallel rank yields the
same number of microbatches per step. Every sample of an epoch is trained exactly once, and a
resumed epoch yields the same microbatches as the interrupted one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torch.utils.data import DataLoader, Sampler

from dflop_ds.schedule.epoch import epoch_permutation, global_batches
from dflop_ds.schedule.fit_batches import MemoryCapError, fit_batches
from dflop_ds.schedule.sampler import BatchSchedule, GlobalBatchSampler

logger = logging.getLogger(__name__)


def trainer_data_parallel_coords(process_index: int, world_size: int, tp_size: int) -> tuple[int, int]:
    """``(dp_rank, dp_size)`` of the Trainer process ``process_index`` of ``world_size`` when ranks
    form a ``(data, tensor)`` mesh of ``tp_size`` tensor-parallel peers, peers adjacent (DeepSpeed
    AutoTP's and Accelerate's layout): the peers of a tensor-parallel group share one data-parallel
    rank, so they get identical microbatches."""
    if tp_size < 1 or world_size % tp_size:
        raise ValueError(f"the world size {world_size} is not a multiple of the tensor-parallel size {tp_size}")
    return process_index // tp_size, world_size // tp_size


def epoch_batch_count(
    n_samples: int, global_batch_size: int, min_batch: int, drop_last: bool = False
) -> tuple[int, int]:
    """``(batches, dropped)``: how many global batches an epoch of ``n_samples`` has (the full ones,
    plus the short rest when it holds at least ``min_batch`` samples and ``drop_last`` is off) and
    how many of its samples are left out."""
    full, rest = divmod(n_samples, global_batch_size)
    if rest and (drop_last or rest < min_batch):
        return full, rest
    return full + (1 if rest else 0), 0


def last_step_microbatches(n_samples: int, global_batch_size: int, gas: int, dp: int, drop_last: bool = False) -> int:
    """Microbatches per data-parallel rank in an epoch's last step: ``gas``, except when the epoch
    ends on a trained short batch of fewer than ``gas x dp`` samples (at least ``dp``, and
    ``drop_last`` off): then ``rest // dp``, so every microbatch holds a sample."""
    rest = n_samples % global_batch_size
    if drop_last or rest < dp or rest >= gas * dp:
        return gas
    return rest // dp


def epoch_batches_with_tail(
    n_samples: int, seed: int, epoch: int, global_batch_size: int, min_batch: int, drop_last: bool = False
) -> tuple[list[np.ndarray], int]:
    """``(batches, dropped)``: the global batches of ``epoch`` (the full ones of
    :func:`~dflop_ds.schedule.epoch.global_batches`, then the short rest of the permutation as
    :func:`epoch_batch_count` keeps it) and how many samples of the epoch are left out."""
    order = epoch_permutation(n_samples, seed, epoch)
    batches = global_batches(order, global_batch_size, min_batch)
    count, dropped = epoch_batch_count(n_samples, global_batch_size, min_batch, drop_last)
    if count > len(batches):
        batches.append(order[len(batches) * global_batch_size :])
    return batches, dropped


@dataclass
class ScheduleLog:
    """The schedules a rank has drawn microbatches from since the last :meth:`drain`."""

    imbalance: list[float] = field(default_factory=list)
    step_over_bound: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    schedule_s: list[float] = field(default_factory=list)

    def add(self, schedule: BatchSchedule) -> None:
        """Record one global batch's schedule."""
        self.imbalance.append(float(np.max(schedule.imbalance())))
        over = schedule.step_over_bound()
        if over is not None:
            self.step_over_bound.append(over)
        self.step_s.append(float(schedule.split.step))
        self.schedule_s.append(float(schedule.schedule_s))

    def drain(self) -> dict[str, float]:
        """Mean predicted imbalance (slowest / mean microbatch), mean predicted step over its lower
        bound under the run's sync model (when the splitter bounds it), mean predicted step seconds
        and total scheduler seconds of the schedules since the last call, as Trainer log entries
        (empty when there were none)."""
        if not self.imbalance:
            return {}
        logs = {
            "dflop_predicted_imbalance": float(np.mean(self.imbalance)),
            "dflop_predicted_step_s": float(np.mean(self.step_s)),
            "dflop_schedule_s": float(np.sum(self.schedule_s)),
        }
        if self.step_over_bound:
            logs["dflop_predicted_step_over_bound"] = float(np.mean(self.step_over_bound))
        for values in (self.imbalance, self.step_over_bound, self.step_s, self.schedule_s):
            values.clear()
        return logs


class TrainerBatchSampler(Sampler[list[int]]):
    """This rank's microbatches of a Trainer epoch, cut and balanced by a dflop-ds sampler.

    Args:
        sampler: the dflop-ds sampler: its ``schedule`` splits each global batch; its
            ``dp_rank``, ``seed``, ``prefetch`` and ``schedule_timeout_s`` apply.
        drop_last: drop every epoch's short last batch (the Trainer's ``dataloader_drop_last``).
        last_step_sampler: the same sampler built for the epoch's last, shorter step
            (``gradient_accumulation_steps`` = :func:`last_step_microbatches`); required when
            that is below ``sampler``'s, ignored otherwise.
    """

    def __init__(
        self,
        sampler: GlobalBatchSampler,
        drop_last: bool = False,
        last_step_sampler: GlobalBatchSampler | None = None,
    ) -> None:
        self.sampler = sampler
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self.log = ScheduleLog()
        n, size, gas, dp = len(sampler.shapes), sampler.global_batch_size, sampler.n_mb, sampler.dp_size
        self.batches_per_epoch, self.dropped_per_epoch = epoch_batch_count(n, size, dp, self.drop_last)
        #: microbatches per rank in the epoch's last step
        self.last_step_microbatches = last_step_microbatches(n, size, gas, dp, self.drop_last)
        self.last_step_sampler = sampler
        if self.last_step_microbatches < gas:
            if last_step_sampler is None or last_step_sampler.n_mb != self.last_step_microbatches:
                raise ValueError(
                    f"the last {n % size} samples of an epoch fill {self.last_step_microbatches} microbatches per"
                    f" rank, not {gas}: pass last_step_sampler= built with gradient_accumulation_steps="
                    f"{self.last_step_microbatches}"
                )
            self.last_step_sampler = last_step_sampler
            logger.info(
                "the last step of every epoch trains the last %d samples in %d microbatches per rank (not %d)",
                n % size,
                self.last_step_microbatches,
                gas,
            )
        if self.dropped_per_epoch:
            logger.warning(
                "%d of %d samples of every epoch are not trained (a different %d each epoch): they are left after"
                " the full global batches of %d, and %s",
                self.dropped_per_epoch,
                n,
                self.dropped_per_epoch,
                size,
                "drop_last is set" if self.drop_last else f"fewer than the {dp} data-parallel ranks",
            )

    def set_epoch(self, epoch: int) -> None:
        """Iterate Trainer epoch ``epoch`` next."""
        self.epoch = int(epoch)

    def __len__(self) -> int:
        """Microbatches this rank yields per Trainer epoch."""
        return (self.batches_per_epoch - 1) * self.sampler.n_mb + self.last_step_microbatches

    def batches(self, epoch: int) -> list[np.ndarray]:
        """The global batches of ``epoch`` (dataset indices) as they are trained: under a memory cap,
        with samples exchanged between them until each has a split under it (the full batches by
        :attr:`sampler`, the short last one by :attr:`last_step_sampler`), the same on every rank
        and resume; a batch that still does not fit is a
        :class:`~dflop_ds.schedule.fit_batches.MemoryCapError` naming it."""
        sampler = self.sampler
        batches = epoch_batches_with_tail(
            len(sampler.shapes), sampler.seed, epoch, sampler.global_batch_size, sampler.dp_size, self.drop_last
        )[0]
        cap, memory = getattr(sampler, "memory_cap", None), getattr(sampler, "memory", None)
        if cap is None or memory is None or not hasattr(sampler, "fit_under_cap"):
            return batches  # no cap, or a baseline splitter that cuts as its users run it, whatever the memory
        fitted, unfit = fit_batches(batches, memory, self._fits_under_cap)
        if unfit:
            b = unfit[0]
            owner: Any = sampler if len(fitted[b]) == sampler.global_batch_size else self.last_step_sampler
            raise MemoryCapError(owner._describe_unfit(epoch, b, fitted[b], cap, len(unfit)))
        return fitted

    def _fits_under_cap(self, batch: np.ndarray) -> bool:
        """Whether ``batch`` has a split under the memory cap by the sampler that splits it (a full
        global batch: :attr:`sampler`; the epoch's short last one: :attr:`last_step_sampler`)."""
        owner: Any = self.sampler if len(batch) == self.sampler.global_batch_size else self.last_step_sampler
        return owner.fit_under_cap(batch, owner.memory_cap) is not None

    def check_epochs(self, epochs: int) -> None:
        """Fit the global batches of the first ``epochs`` epochs now, before training, so that a
        batch the memory cap cannot split is an error before step 0, not when training reaches it
        (nothing to check without a cap)."""
        if getattr(self.sampler, "memory_cap", None) is None or not hasattr(self.sampler, "fit_under_cap"):
            return
        for epoch in range(max(1, int(epochs))):
            self.batches(epoch)

    def schedules(self, epoch: int) -> Iterator[BatchSchedule]:
        """The schedules of ``epoch``'s global batches in order, computed as the dflop-ds sampler
        computes its own (``prefetch`` ahead in a thread, ``schedule_timeout_s`` per batch); the
        last by :attr:`last_step_sampler`."""
        batches = self.batches(epoch)
        if self.last_step_sampler is self.sampler:
            yield from self.sampler._schedules(epoch, 0, batches)
            return
        yield from self.sampler._schedules(epoch, 0, batches[:-1])
        yield from self.last_step_sampler._schedules(epoch, len(batches) - 1, batches)

    def close(self) -> None:
        """Stop the background scheduling threads (at the end of training, see
        :func:`dflop_ds.rank_lifecycle.finish_rank`)."""
        self.sampler.close()
        if self.last_step_sampler is not self.sampler:
            self.last_step_sampler.close()

    def __iter__(self) -> Iterator[list[int]]:
        """This rank's microbatches of the current Trainer epoch, in training order, as lists of
        plain ``int`` dataset indices (the Trainer's loss takes its denominator from the labels it
        counts, ``num_items_in_batch``, so an index carries nothing else)."""
        for schedule in self.schedules(self.epoch):
            self.log.add(schedule)
            for microbatch in schedule.split.ranks[self.sampler.dp_rank]:
                yield [int(i) for i in microbatch]


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
    "epoch_batch_count",
    "epoch_batches_with_tail",
    "last_step_microbatches",
    "trainer_data_parallel_coords",
]
