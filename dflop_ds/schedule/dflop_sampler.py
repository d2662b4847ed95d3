"""DFLOP's sampler: every global batch split into balanced microbatches on predicted costs, each
epoch's batches first fitted under the memory cap (:mod:`dflop_ds.schedule.fit_batches`)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import numpy as np

from dflop_ds.schedule.epoch import carried_into, epoch_batches, first_batch
from dflop_ds.schedule.fit_batches import MemoryCapError, fit_batches
from dflop_ds.schedule.global_sampler import GlobalBatchSampler
from dflop_ds.schedule.memory import NAMED, fit_under_cap, microbatch_bytes, oversize_samples
from dflop_ds.schedule.partition import InfeasibleError
from dflop_ds.schedule.prefetch import ScheduleTimeoutError, run_with_deadline
from dflop_ds.schedule.splitters import FALLBACK_SUFFIX, DFLOPSplitter, SplitResult
from dflop_ds.shapes import SampleShape

logger = logging.getLogger(__name__)


class DFLOPBatchSampler(GlobalBatchSampler):
    """DFLOP's sampler: every global batch split into balanced microbatches on predicted costs.

    ``time_limit_s`` and ``ilp_nodes`` bound the exact solver per batch; with both 0 (the
    default) the fast deterministic heuristic runs alone. Several ranks need identical schedules:
    use ``ilp_nodes`` (no clock involved) rather than ``time_limit_s`` there. An exact solve
    still running after half of ``schedule_timeout_s`` is abandoned for the heuristic (its
    ``solver`` ends in ``+fallback``). The split minimises the step under the sampler's
    ``sync`` model (see :class:`~dflop_ds.schedule.splitters.DFLOPSplitter`).

    ``memory_cap`` (bytes, None: no cap) bounds every microbatch's predicted memory (the cost
    model's ``predict_memory`` summed over its columns, :mod:`dflop_ds.schedule.memory`). A sample
    predicted above it alone is an :class:`~dflop_ds.schedule.memory.OversizeSampleError` naming
    it, raised here, before training; with ``allow_oversize`` it is trained alone in a microbatch
    of its own (a warning names it). A global batch has only ``n_mb * dp`` microbatches, so each
    epoch is fitted before it trains (:mod:`dflop_ds.schedule.fit_batches`): a batch whose samples
    cannot be split under the cap exchanges its largest with smaller ones of the epoch's other
    batches; a batch that still does not fit is a :class:`MemoryCapError` naming it and the cap,
    raised here for the first epoch and by :meth:`check_steps` for the run's others. Every
    sample is still trained exactly once, and a resume computes the same batches.
    """

    method = "dflop"

    def __init__(
        self,
        shapes: Sequence[SampleShape],
        *,
        time_limit_s: float = 0.0,
        ilp_nodes: int = 0,
        allow_oversize: bool = False,
        **kwargs,
    ) -> None:
        self.time_limit_s = float(time_limit_s)
        self.ilp_nodes = int(ilp_nodes)
        self.allow_oversize = bool(allow_oversize)
        super().__init__(shapes, **kwargs)
        if self.memory is not None and self.memory_cap is not None:
            oversize_samples(self.shapes, self.memory, self.memory_cap, self.allow_oversize)
            self.batches_in_epoch(self.epoch)  # a batch that cannot fit is refused now, not in training

    # -- the memory cap, decided per epoch before training -------------------------------------
    def fit_under_cap(self, batch: np.ndarray, cap: float) -> list[list[int]] | None:
        """A split of ``batch`` (positions) into ``n_mb * dp`` microbatches under ``cap`` that
        does not depend on costs (:func:`~dflop_ds.schedule.memory.fit_under_cap`), or None."""
        assert self.memory is not None
        shapes = [self.shapes[i] for i in batch]
        key = self.lengths[batch] if self.padded else self.memory[batch]
        return fit_under_cap(
            self.memory[batch],
            key,
            self.n_mb * self.dp_size,
            lambda rows: microbatch_bytes(self.cost_model, [shapes[r] for r in rows]),
            cap,
        )

    def check_steps(self, steps: int) -> None:
        """Fit the global batches of every epoch the first ``steps`` steps (one global batch
        each, counted from the run's start) reach, so that a batch the memory cap cannot split
        is a :class:`MemoryCapError` now, before training, not when training reaches it."""
        if self.memory is None:
            return
        n, size = len(self.shapes), self.global_batch_size
        current = self._cached_epoch  # kept: training starts with it
        epoch = 0
        while first_batch(epoch, n, size, self.drop_last) < steps:
            if current is None or current[0] != epoch:
                self.batches_in_epoch(epoch)
            epoch += 1
        self._cached_epoch = current or self._cached_epoch

    def fit_epoch(self, epoch: int, batches: list[np.ndarray]) -> list[np.ndarray]:
        """Under a memory cap, ``batches`` with samples exchanged between them until each has a
        split under the cap (:func:`~dflop_ds.schedule.fit_batches.fit_batches`); the same on every
        rank and resume. Raises :class:`MemoryCapError` naming the first batch that still does not fit."""
        return self._fit_epoch(epoch, batches, self.memory_cap)

    def _fit_epoch(self, epoch: int, batches: list[np.ndarray], cap: float | None) -> list[np.ndarray]:
        if self.memory is None or cap is None:
            return batches
        pinned = 0 if self.drop_last else carried_into(epoch, len(self.shapes), self.global_batch_size)
        fitted, unfit = fit_batches(batches, self.memory, lambda b: self.fit_under_cap(b, cap) is not None, pinned)
        if unfit:
            raise MemoryCapError(self._describe_unfit(epoch, unfit[0], fitted[unfit[0]], cap, len(unfit)))
        return fitted

    def _describe_unfit(self, epoch: int, batch_id: int, batch: np.ndarray, cap: float, n_unfit: int) -> str:
        """Why a batch cannot be split under ``cap`` and what would let it."""
        assert self.memory is not None
        usage = self.memory[batch]
        alone = int((usage > cap).sum())
        total = float(usage[usage <= cap].sum())
        needed = alone + int(np.ceil(total / cap))
        largest = np.argsort(-usage, kind="stable")[:NAMED]
        named = ", ".join(f"{self.shapes[batch[p]].sample_id!r} ({usage[p]:.4g} bytes)" for p in largest)
        oversize = f"; {alone} of them exceed the cap alone and need a microbatch each" if alone else ""
        others = f" ({n_unfit - 1} more batches of this epoch do not fit either)" if n_unfit > 1 else ""
        return (
            f"epoch {epoch} global batch {batch_id}{others} cannot be split into {self.n_mb * self.dp_size}"
            f" microbatches ({self.n_mb} gradient accumulation steps x data-parallel size {self.dp_size}) that"
            f" each stay within the memory cap of {cap:.4g} bytes (dflop.sampler.memory_cap_bytes), even after"
            f" exchanging samples with the epoch's other batches: its {len(batch)} samples are predicted at"
            f" {total:.4g} bytes{oversize}, at least {needed} microbatches' worth; the largest: {named}."
            " Raise the cap, raise gradient_accumulation_steps, or lower the global batch size (train_batch_size)"
        )

    def state_dict(self) -> dict:
        """The base state and the memory cap (the batches of an epoch depend on it)."""
        return {**super().state_dict(), "memory_cap": self.memory_cap}

    def load_state_dict(self, state: dict) -> None:
        """The base checks; a state taken inside an epoch whose batches the memory cap rearranged
        also needs the cap it was taken under (the epoch's batches would differ)."""
        before = self.position
        super().load_state_dict(state)
        theirs = state.get("memory_cap", self.memory_cap)
        at_start = self.position.batch == 0 and self.position.microbatch == 0
        if theirs == self.memory_cap or at_start:
            return
        epoch = self.position.epoch
        plain = epoch_batches(len(self.shapes), self.seed, epoch, self.global_batch_size, self.drop_last)
        try:
            theirs_batches = self._fit_epoch(epoch, plain, theirs)
            same = self.memory is not None and all(map(np.array_equal, theirs_batches, self.batches_in_epoch(epoch)))
        except InfeasibleError:
            same = False
        if not same:
            self.position = before
            raise ValueError(
                f"sampler state has memory_cap={theirs!r}, this sampler has {self.memory_cap!r}: the cap moved"
                f" samples between the global batches of epoch {epoch}, so resuming inside it needs the same cap"
                f" (set dflop.sampler.memory_cap_bytes to {theirs!r})"
            )

    def balanced_split(self, batch: np.ndarray, costs: np.ndarray, batch_seed: int, exact: bool) -> SplitResult:
        """:class:`DFLOPSplitter`'s split of ``batch``, with the exact solver's limits when ``exact``,
        under the memory budget (:meth:`memory_budget`; the splitter re-weights over-cap
        microbatches). Should no split be found under the cap, the cost-blind split
        :meth:`fit_under_cap` found for the batch before training is used."""
        splitter = DFLOPSplitter(self.time_limit_s if exact else 0.0, self.ilp_nodes if exact else 0)
        request = self.split_request(batch, costs, batch_seed)
        try:
            return splitter.split(request)
        except InfeasibleError:
            fitted = self.fit_under_cap(batch, self.memory_cap) if self.memory_cap is not None else None
            if fitted is None:
                raise
            return DFLOPSplitter().split_buckets(request, fitted, "memory-fit")

    def split(self, batch: np.ndarray, costs: np.ndarray, batch_seed: int) -> SplitResult:
        """Balanced split; an exact solve past half of ``schedule_timeout_s`` falls back to the heuristic."""
        if (self.time_limit_s <= 0 and self.ilp_nodes <= 0) or self.schedule_timeout_s is None:
            return self.balanced_split(batch, costs, batch_seed, exact=True)
        budget = self.schedule_timeout_s / 2
        try:
            return run_with_deadline(
                lambda: self.balanced_split(batch, costs, batch_seed, exact=True), budget, "the exact solver"
            )
        except ScheduleTimeoutError:
            logger.warning(
                "the exact solver overran half of schedule_timeout_s (%g s); using the heuristic split", budget
            )
        result = self.balanced_split(batch, costs, batch_seed, exact=False)
        return dataclasses.replace(result, solver=result.solver + FALLBACK_SUFFIX)
