"""Batch samplers that feed DeepSpeed's pipeline engine one microbatch per ``next()``.

Every global batch is drawn from a seeded per-epoch permutation and split into exactly
``gradient_accumulation_steps`` microbatches for each data-parallel rank. The split is a pure
function of ``(seed, epoch, batch)``: the first and last pipeline stages of a rank, which both
read the data iterator, and all other ranks compute the same schedule without talking.

Use it in existing DeepSpeed code::

    sampler = DFLOPBatchSampler(shapes, global_batch_size=64,
                                gradient_accumulation_steps=engine.gradient_accumulation_steps(),
                                dp_rank=engine.grid.get_data_parallel_rank(),
                                dp_size=engine.grid.get_data_parallel_world_size(),
                                cost_model=cost_model)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=collate)
    data_iter = iter(deepspeed.utils.RepeatingLoader(loader))
    engine.train_batch(data_iter)
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Protocol, Sequence

import numpy as np

from dflop_ds.schedule.epoch import epoch_permutation, global_batches
from dflop_ds.schedule.index import ScheduledIndex
from dflop_ds.schedule.prefetch import BackgroundMap
from dflop_ds.schedule.split import SplitResult, split_balanced, split_stock
from dflop_ds.shapes import SampleShape


class CostAdjuster(Protocol):
    """Adjusts predicted costs from what training observed (e.g. adaptive correction).

    ``adjust(version, costs, shapes)`` returns the costs to schedule with, using the adjuster's
    state as of ``version`` (the number of completed training steps it reflects); it may block
    until that version exists. Every rank must hold the same state per version, so schedules
    stay identical. An adjuster whose costs are in other columns than the cost model's (e.g.
    seconds per pipeline stage) sets ``replaces_columns = True``; a microbatch then costs the
    sum of its samples' adjusted costs.
    """

    def adjust(self, version: int, costs: np.ndarray, shapes: Sequence[SampleShape]) -> np.ndarray: ...


class CostPredictor(Protocol):
    """What a sampler needs from a cost model (``CostModel`` and ``ProxyCost`` both fit)."""

    def predict_samples(self, shapes: Sequence[SampleShape]) -> np.ndarray: ...


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

    def imbalance(self) -> np.ndarray:
        """Predicted max / mean microbatch cost, per cost column (1.0 is perfect balance)."""
        costs = self.split.predicted.reshape(-1, self.split.predicted.shape[-1])
        mean = costs.mean(axis=0)
        return np.divide(costs.max(axis=0), mean, out=np.ones_like(mean), where=mean > 0)


class GlobalBatchSampler:
    """Base of the batch samplers: epochs, global batches, background scheduling, iteration.

    Args:
        shapes: one :class:`SampleShape` per dataset index.
        global_batch_size: samples per optimizer step over all data-parallel ranks.
        gradient_accumulation_steps: microbatches per rank per step (DeepSpeed's GAS).
        dp_rank, dp_size: this process's data-parallel rank and the data-parallel world size.
        cost_model: predicts per-sample ``[encoder, llm]`` costs (see ``ProxyCost``).
        seed: seeds the epoch permutations.
        prefetch: global batches scheduled ahead in a background thread (0: inline).
        label_tokens_fn: supervised tokens of a sample as the loss will count them (default
            ``shape.label_tokens``); the loss denominator of a batch is their sum.
        cost_adjuster: optional :class:`CostAdjuster`; global batch ``g`` (counted over epochs)
            is scheduled with its state after step ``g - prefetch - 1``, so scheduling ahead
            never waits on the step being trained.
    """

    method = "base"

    def __init__(
        self,
        shapes: Sequence[SampleShape],
        *,
        global_batch_size: int,
        gradient_accumulation_steps: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        cost_model: Optional[CostPredictor] = None,
        seed: int = 0,
        prefetch: int = 1,
        label_tokens_fn: Optional[Callable[[SampleShape], int]] = None,
        cost_adjuster: Optional[CostAdjuster] = None,
    ) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, dp_size={dp_size}), got {dp_rank}")
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch}")
        if cost_model is None:
            from dflop_ds.profile.proxy import ProxyCost

            cost_model = ProxyCost()
        self.shapes = list(shapes)
        self.global_batch_size = int(global_batch_size)
        self.n_mb = int(gradient_accumulation_steps)
        self.dp_rank = int(dp_rank)
        self.dp_size = int(dp_size)
        self.cost_model = cost_model
        self.seed = int(seed)
        self.prefetch = int(prefetch)
        self._ahead: Optional[BackgroundMap] = None
        self.costs = np.asarray(cost_model.predict_samples(self.shapes), dtype=float).reshape(len(self.shapes), -1)
        count = label_tokens_fn or (lambda shape: shape.label_tokens)
        self.label_tokens = np.array([count(s) for s in self.shapes], dtype=np.int64)
        self.lengths = np.array([s.llm_tokens for s in self.shapes], dtype=float)
        self.cost_adjuster = cost_adjuster
        self.epoch = 0
        self.next_batch = 0
        self.last_schedule: Optional[BatchSchedule] = None
        self.batches_per_epoch = len(self.batches_in_epoch())  # the same every epoch; validates sizes

    # -- the schedule: pure in (seed, epoch, batch) -------------------------------------------
    def batches_in_epoch(self, epoch: Optional[int] = None) -> list[np.ndarray]:
        """The global batches (arrays of dataset indices) of ``epoch`` (default: the current)."""
        order = epoch_permutation(len(self.shapes), self.seed, self.epoch if epoch is None else epoch)
        return global_batches(order, self.global_batch_size, self.n_mb * self.dp_size)

    def split(self, batch: np.ndarray, costs: np.ndarray, batch_seed: int) -> SplitResult:
        """Split one global batch (``costs`` its rows' costs) into per-rank microbatches."""
        raise NotImplementedError

    def batch_costs(self, epoch: int, batch_id: int, batch: np.ndarray) -> np.ndarray:
        """Predicted costs of ``batch``'s samples, adjusted when a cost adjuster is set."""
        costs = self.costs[batch]
        if self.cost_adjuster is None:
            return costs
        global_batch = epoch * self.batches_per_epoch + batch_id
        version = global_batch - self.prefetch - 1
        if version < 0:
            return costs
        return np.asarray(self.cost_adjuster.adjust(version, costs, [self.shapes[i] for i in batch]), dtype=float)

    def _microbatch_cost(self, batch: np.ndarray, costs: Optional[np.ndarray] = None):
        """The cost model's collated-microbatch predictor over positions in ``batch``, if any.

        With adjusted ``costs`` (from the cost adjuster) of the same columns, each column is
        scaled by the microbatch's adjusted / unadjusted cost ratio; if the adjuster changed the
        cost columns (``replaces_columns``), a microbatch costs the sum of its samples' adjusted
        costs (None).
        """
        predict = getattr(self.cost_model, "predict_microbatch", None)
        if predict is None:
            return None
        shapes = [self.shapes[i] for i in batch]
        if costs is None or self.cost_adjuster is None:
            return lambda positions: predict([shapes[p] for p in positions])
        base, adjusted = self.costs[batch], np.asarray(costs, dtype=float)
        if adjusted.shape != base.shape or getattr(self.cost_adjuster, "replaces_columns", False):
            return None
        if np.array_equal(adjusted, base):
            return lambda positions: predict([shapes[p] for p in positions])

        def corrected(positions):
            raw = np.asarray(predict([shapes[p] for p in positions]), dtype=float)
            before, after = base[positions].sum(axis=0), adjusted[positions].sum(axis=0)
            return raw * np.divide(after, before, out=np.ones_like(after), where=before > 0)

        return corrected

    def schedule(self, epoch: int, batch_id: int, batch: np.ndarray) -> BatchSchedule:
        """Compute the schedule of one global batch."""
        start = time.perf_counter()
        costs = self.batch_costs(epoch, batch_id, batch)
        split = self.split(batch, costs, batch_seed=self.seed * 1_000_003 + epoch * 10_007 + batch_id)
        elapsed = time.perf_counter() - start
        tokens = int(self.label_tokens[batch].sum())
        denominator = max(tokens, 1) / (self.n_mb * self.dp_size)
        return BatchSchedule(epoch, batch_id, split, denominator, tokens, elapsed)

    # -- iteration -----------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first batch at the next iteration."""
        self.epoch = int(epoch)
        self.next_batch = 0

    def __len__(self) -> int:
        """Microbatches this rank yields per epoch."""
        return self.batches_per_epoch * self.n_mb

    def _schedules(self, epoch: int, start: int) -> Iterator[BatchSchedule]:
        batches = self.batches_in_epoch(epoch)
        keys = range(start, len(batches))
        if self.prefetch == 0:
            yield from (self.schedule(epoch, b, batches[b]) for b in keys)
            return
        with BackgroundMap(lambda b: self.schedule(epoch, b, batches[b]), keys, depth=self.prefetch) as ahead:
            self._ahead = ahead
            yield from ahead

    def close(self, wait_s: float = 60.0) -> None:
        """Stop background scheduling at the end of training and wait (up to ``wait_s``) for the
        batch being scheduled to finish, so the process exits with no thread inside a solver."""
        if self._ahead is not None:
            self._ahead.close(wait_s=wait_s)

    def __iter__(self) -> Iterator[list[ScheduledIndex]]:
        """Yield this rank's microbatches of the rest of the current epoch, then move to the next
        epoch (so a ``RepeatingLoader`` sees a fresh order every epoch).

        The position (:meth:`state_dict`) advances when a batch's last microbatch is handed out,
        so a checkpoint taken after a training step resumes at the next batch.
        """
        epoch = self.epoch
        for sched in self._schedules(epoch, self.next_batch):
            self.last_schedule = sched
            microbatches = sched.split.ranks[self.dp_rank]
            for j, microbatch in enumerate(microbatches):
                if j == len(microbatches) - 1:
                    self._advance(epoch, sched.batch_id + 1)
                yield [ScheduledIndex(i, sched.loss_denominator, sched.batch_id) for i in microbatch]

    def _advance(self, epoch: int, next_batch: int) -> None:
        if next_batch >= self.batches_per_epoch:
            self.set_epoch(epoch + 1)
        else:
            self.epoch, self.next_batch = epoch, next_batch

    # -- checkpointing -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Where the sampler is: enough to resume at the next unconsumed global batch."""
        return {"method": self.method, "seed": self.seed, "epoch": self.epoch, "next_batch": self.next_batch,
                "n_samples": len(self.shapes), "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict`; refuses a state from a different dataset or batch size."""
        for key in ("seed", "n_samples", "global_batch_size"):
            mine = self.state_dict()[key]
            if state.get(key) != mine:
                raise ValueError(f"sampler state has {key}={state.get(key)!r}, this sampler has {mine!r}")
        self.epoch = int(state["epoch"])
        self.next_batch = int(state["next_batch"])


class StockBatchSampler(GlobalBatchSampler):
    """Stock DeepSpeed behaviour: random order, fixed sample count per microbatch."""

    method = "stock"

    def split(self, batch: np.ndarray, costs: np.ndarray, batch_seed: int) -> SplitResult:
        """Contiguous equal-count chunks (see :func:`split_stock`)."""
        return split_stock(batch.tolist(), costs, self.n_mb, self.dp_size, self._microbatch_cost(batch, costs))


class DFLOPBatchSampler(GlobalBatchSampler):
    """DFLOP's sampler: every global batch split into balanced microbatches on predicted costs.

    ``time_limit_s`` and ``ilp_nodes`` bound the exact solver per batch; with both 0 (the
    default) the fast deterministic heuristic runs alone. Several ranks need identical schedules:
    use ``ilp_nodes`` (no clock involved) rather than ``time_limit_s`` there. ``lockstep=True``
    is for engines without a pipeline (ZeRO data parallel), whose ranks synchronise in every
    microbatch: microbatch ``k`` of every rank is balanced on its own (see
    :func:`~dflop_ds.schedule.split.split_balanced`).
    """

    method = "dflop"

    def __init__(self, shapes: Sequence[SampleShape], *, time_limit_s: float = 0.0, ilp_nodes: int = 0,
                 lockstep: bool = False, **kwargs) -> None:
        self.time_limit_s = float(time_limit_s)
        self.ilp_nodes = int(ilp_nodes)
        self.lockstep = bool(lockstep)
        super().__init__(shapes, **kwargs)

    def split(self, batch: np.ndarray, costs: np.ndarray, batch_seed: int) -> SplitResult:
        """Balanced split (see :func:`split_balanced`)."""
        return split_balanced(
            batch.tolist(), costs, self.n_mb, self.dp_size, self._microbatch_cost(batch, costs),
            time_limit_s=self.time_limit_s, seed=batch_seed, lengths=self.lengths[batch], node_limit=self.ilp_nodes,
            lockstep=self.lockstep,
        )


def make_sampler(method: str, shapes: Sequence[SampleShape], **kwargs) -> GlobalBatchSampler:
    """Build the sampler named ``method`` (``"dflop"`` or ``"stock"``)."""
    samplers = {"dflop": DFLOPBatchSampler, "stock": StockBatchSampler}
    if method not in samplers:
        raise ValueError(f"unknown sampler {method!r}: choose one of {sorted(samplers)}")
    if method == "stock":
        for key in ("time_limit_s", "ilp_nodes", "lockstep"):
            kwargs.pop(key, None)
    return samplers[method](shapes, **kwargs)
