"""The core every batch sampler shares (:class:`GlobalBatchSampler`): seeded epochs of global
batches, their costs (adjusted by a :class:`~dflop_ds.schedule.batch_schedule.CostAdjuster`), the
split request a splitter gets, background scheduling, iteration and the resumable position.
Samplers add only how a global batch is split (:mod:`dflop_ds.schedule.sampler`)."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from dflop_ds.cost import CostModel, ProxyCost, packs_microbatches
from dflop_ds.cost.batched import microbatch_cost_by_position
from dflop_ds.schedule.batch_schedule import SCHEDULE_TIMEOUT_S, BatchSchedule, CostAdjuster
from dflop_ds.schedule.epoch import check_batch_sizes, dropped_per_epoch, epoch_batches, first_batch
from dflop_ds.schedule.index import ScheduledIndex
from dflop_ds.schedule.memory import microbatch_bytes, sample_bytes
from dflop_ds.schedule.prefetch import BackgroundMap, run_with_deadline
from dflop_ds.schedule.splitters import MemoryBudget, SplitRequest, SplitResult
from dflop_ds.schedule.state import Position, dataset_fingerprint, describe_dataset
from dflop_ds.shapes import SampleShape, check_shape_values
from dflop_ds.sync import SyncModel, as_sync_model

logger = logging.getLogger(__name__)


class GlobalBatchSampler:
    """Base of the batch samplers: epochs, global batches, background scheduling, iteration.

    Args:
        shapes: one :class:`SampleShape` per dataset index.
        global_batch_size: samples per optimizer step over all data-parallel ranks.
        gradient_accumulation_steps: microbatches per rank per step (DeepSpeed's GAS).
        dp_rank, dp_size: this process's data-parallel rank and the data-parallel world size.
        cost_model: a :class:`~dflop_ds.cost.CostModel` (None: :class:`~dflop_ds.cost.ProxyCost`);
            the sampler uses its ``predict_samples``, ``predict_microbatch`` and, under a memory
            cap, ``predict_memory``.
        seed: seeds the epoch permutations.
        prefetch: global batches scheduled ahead in a background thread (0: inline).
        label_tokens_fn: supervised tokens of a sample as the loss will count them (default
            ``shape.label_tokens``); the loss denominator of a batch is their sum.
        cost_adjuster: optional :class:`CostAdjuster`; global batch ``g`` (counted over epochs)
            is scheduled with its state after step ``g - prefetch - 1``, so scheduling ahead
            never waits on the step being trained.
        drop_last: drop (and count, :attr:`dropped_per_epoch`) the samples of each epoch that
            do not fill a global batch instead of carrying them into the next epoch.
        schedule_timeout_s: the longest the training loop waits for one global batch's
            schedule before :class:`ScheduleTimeoutError` naming the epoch and batch (None:
            forever). An exact solve that takes over half of it is abandoned for the heuristic.
        sync: how the engine's data-parallel ranks meet (:mod:`dflop_ds.sync`, derived once by
            the caller with :func:`~dflop_ds.sync.sync_model_of`); every split request carries
            it, so DFLOP balances for it and every split reports its step under it. The
            default, ``pipeline``, is DeepSpeed's pipeline engine.
        memory_cap: bytes no microbatch of two or more samples may take (the cost model's
            ``predict_memory``, :mod:`dflop_ds.schedule.memory`; None: no cap); every split
            request carries it (:meth:`memory_budget`) and a split over it is an error naming
            it (:class:`~dflop_ds.schedule.splitters.OverBudgetError`).
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
        cost_model: CostModel | None = None,
        seed: int = 0,
        prefetch: int = 1,
        label_tokens_fn: Callable[[SampleShape], int] | None = None,
        cost_adjuster: CostAdjuster | None = None,
        drop_last: bool = False,
        schedule_timeout_s: float | None = SCHEDULE_TIMEOUT_S,
        sync: SyncModel | str = SyncModel.PIPELINE,
        memory_cap: float | None = None,
    ) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, dp_size={dp_size}), got {dp_rank}")
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch}")
        if schedule_timeout_s is not None and not schedule_timeout_s > 0:
            raise ValueError(
                f"schedule_timeout_s must be > 0 seconds (or None: no deadline), got {schedule_timeout_s!r}"
            )
        if cost_model is None:
            cost_model = ProxyCost()
        self.shapes = list(shapes)
        check_shape_values(self.shapes)
        check_batch_sizes(len(self.shapes), int(global_batch_size), int(gradient_accumulation_steps) * int(dp_size))
        self.global_batch_size = int(global_batch_size)
        self.n_mb = int(gradient_accumulation_steps)
        self.dp_rank = int(dp_rank)
        self.dp_size = int(dp_size)
        self.cost_model = cost_model
        self.seed = int(seed)
        self.prefetch = int(prefetch)
        self._ahead: BackgroundMap | None = None
        self.costs = np.asarray(cost_model.predict_samples(self.shapes), dtype=float).reshape(len(self.shapes), -1)
        count = label_tokens_fn or (lambda shape: shape.label_tokens)
        self.label_tokens = np.array([count(s) for s in self.shapes], dtype=np.int64)
        self.lengths = np.array([s.llm_tokens for s in self.shapes], dtype=float)
        #: packed microbatches cost the sum of their samples: no padding-aware microbatch cost
        self.additive = bool(cost_model.additive)
        #: collated microbatches pad to their longest sample (not packed, even into rows whose
        #: attention spans the row): the splitter gets their lengths
        self.padded = not packs_microbatches(cost_model)
        self.cost_adjuster = cost_adjuster
        self.drop_last = bool(drop_last)
        self.schedule_timeout_s = None if schedule_timeout_s is None else float(schedule_timeout_s)
        self.sync = as_sync_model(sync)
        if memory_cap is not None and not memory_cap > 0:
            raise ValueError(f"memory_cap must be > 0 bytes (or None: no cap), got {memory_cap!r}")
        self.memory_cap = None if memory_cap is None else float(memory_cap)
        self.memory = None if self.memory_cap is None else sample_bytes(cost_model, self.shapes)
        self.dropped_per_epoch = dropped_per_epoch(len(self.shapes), self.global_batch_size, self.drop_last)
        if self.dropped_per_epoch:
            logger.warning(
                "drop_last: %d of %d samples of every epoch are not trained (a different %d each epoch)",
                self.dropped_per_epoch,
                len(self.shapes),
                self.dropped_per_epoch,
            )
        self.fingerprint = dataset_fingerprint(self.shapes)
        self.position = Position()
        self.last_schedule: BatchSchedule | None = None
        self._cached_epoch: tuple[int, list[np.ndarray]] | None = None

    @property
    def epoch(self) -> int:
        """The epoch of the next microbatch to train."""
        return self.position.epoch

    @property
    def next_batch(self) -> int:
        """The global batch (within :attr:`epoch`) of the next microbatch to train."""
        return self.position.batch

    @property
    def batches_per_epoch(self) -> int:
        """Global batches of the current epoch (with carry, epochs differ by at most one)."""
        return self.n_batches(self.epoch)

    def n_batches(self, epoch: int) -> int:
        """Global batches of ``epoch``."""
        n, size = len(self.shapes), self.global_batch_size
        return first_batch(epoch + 1, n, size, self.drop_last) - first_batch(epoch, n, size, self.drop_last)

    # -- the schedule: pure in (seed, epoch, batch) -------------------------------------------
    def batches_in_epoch(self, epoch: int | None = None) -> list[np.ndarray]:
        """The global batches (arrays of exactly ``global_batch_size`` dataset indices) of
        ``epoch`` (default: the current)."""
        epoch = self.epoch if epoch is None else int(epoch)
        if self._cached_epoch is None or self._cached_epoch[0] != epoch:
            batches = epoch_batches(len(self.shapes), self.seed, epoch, self.global_batch_size, self.drop_last)
            self._cached_epoch = (epoch, self.fit_epoch(epoch, batches))
        return self._cached_epoch[1]

    def fit_epoch(self, epoch: int, batches: list[np.ndarray]) -> list[np.ndarray]:
        """``epoch``'s global batches as the sampler trains them (here: ``batches`` as they are;
        a sampler with a memory cap exchanges samples between them so that each fits)."""
        return batches

    def check_steps(self, steps: int) -> None:
        """Refuse now, before training, any global batch of the first ``steps`` steps that the
        sampler could not schedule (nothing to check here: every batch can be split)."""

    def split(self, batch: np.ndarray, costs: np.ndarray, batch_seed: int) -> SplitResult:
        """Split one global batch (``costs`` its rows' costs) into per-rank microbatches."""
        raise NotImplementedError

    def split_request(self, batch: np.ndarray, costs: np.ndarray, batch_seed: int) -> SplitRequest:
        """What a splitter gets for ``batch``: its costs, shapes, the collated-microbatch cost
        (:meth:`_microbatch_cost`) and, unless microbatches are packed, its LLM lengths."""
        return SplitRequest(
            batch.tolist(),
            costs,
            self.n_mb,
            self.dp_size,
            shapes=[self.shapes[i] for i in batch],
            microbatch_cost=self._microbatch_cost(batch, costs),
            lengths=self.lengths[batch] if self.padded else None,
            seed=batch_seed,
            sync=self.sync,
            memory=self.memory_budget(batch),
        )

    def memory_budget(self, batch: np.ndarray) -> MemoryBudget | None:
        """The :class:`~dflop_ds.schedule.splitters.MemoryBudget` of ``batch`` under the memory
        cap: the predicted bytes of each sample and of a collated microbatch (None: no cap)."""
        if self.memory is None or self.memory_cap is None:
            return None
        shapes = [self.shapes[i] for i in batch]
        return MemoryBudget(
            self.memory_cap,
            self.memory[batch],
            lambda rows: microbatch_bytes(self.cost_model, [shapes[r] for r in rows]),
            allow_oversize=True,  # an oversize sample was refused at construction unless allowed
        )

    def batch_costs(self, epoch: int, batch_id: int, batch: np.ndarray) -> np.ndarray:
        """Predicted costs of ``batch``'s samples, adjusted when a cost adjuster is set."""
        costs = self.costs[batch]
        if self.cost_adjuster is None:
            return costs
        global_batch = first_batch(epoch, len(self.shapes), self.global_batch_size, self.drop_last) + batch_id
        version = global_batch - self.prefetch - 1
        if version < 0:
            return costs
        return np.asarray(self.cost_adjuster.adjust(version, costs, [self.shapes[i] for i in batch]), dtype=float)

    def _microbatch_cost(self, batch: np.ndarray, costs: np.ndarray | None = None):
        """The cost model's collated-microbatch predictor over positions in ``batch`` (None when the
        model is ``additive``: a microbatch costs the sum of its samples).

        With adjusted ``costs`` (from the cost adjuster) of the same columns, each column is
        scaled by the microbatch's adjusted / unadjusted cost ratio; if the adjuster changed the
        cost columns (``replaces_columns``), a microbatch costs the sum of its samples' adjusted
        costs (None).
        """
        if self.additive:
            return None
        if costs is None or self.cost_adjuster is None:
            return microbatch_cost_by_position(self.cost_model, [self.shapes[i] for i in batch])
        base, adjusted = self.costs[batch], np.asarray(costs, dtype=float)
        if adjusted.shape != base.shape or self.cost_adjuster.replaces_columns:
            return None
        predict = microbatch_cost_by_position(self.cost_model, [self.shapes[i] for i in batch])
        if np.array_equal(adjusted, base):
            return predict

        def corrected(positions):
            raw = np.asarray(predict(positions), dtype=float)
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
        self.position = Position(int(epoch), 0, 0)

    def __len__(self) -> int:
        """Microbatches this rank yields in the current epoch."""
        return self.batches_per_epoch * self.n_mb

    def _schedules(
        self, epoch: int, start: int, batches: Sequence[np.ndarray] | None = None
    ) -> Iterator[BatchSchedule]:
        """The schedules of ``epoch``'s global batches from ``start`` on (``batches``: the epoch's
        global batches, default :meth:`batches_in_epoch`), ``prefetch`` of them computed ahead in a
        thread (stopped by :meth:`close`); one that takes longer than ``schedule_timeout_s`` is an
        error naming it."""
        batches = self.batches_in_epoch(epoch) if batches is None else batches
        keys = range(start, len(batches))
        timeout = self.schedule_timeout_s

        def one(b: int) -> BatchSchedule:
            return self.schedule(epoch, b, batches[b])

        def name(b: int) -> str:
            return f"epoch {epoch} batch {b}"

        if self.prefetch == 0:
            yield from (run_with_deadline(functools.partial(one, b), timeout, name(b)) for b in keys)
            return
        with BackgroundMap(one, keys, depth=self.prefetch, timeout_s=timeout, describe=name) as ahead:
            self._ahead = ahead
            yield from ahead

    def close(self, wait_s: float = 60.0) -> None:
        """Stop background scheduling at the end of training and wait (up to ``wait_s``) for the
        batch being scheduled to finish, so the process exits with no thread inside a solver."""
        if self._ahead is not None:
            self._ahead.close(wait_s=wait_s)

    def scheduled_microbatches(self) -> Iterator[tuple[Position, BatchSchedule, list[ScheduledIndex]]]:
        """This rank's microbatches from the current position to the end of its epoch, each as
        ``(position after it, its batch's schedule, its indices)``, without moving the position
        (:meth:`consumed` does, once the caller has the microbatch)."""
        start = self.position
        for sched in self._schedules(start.epoch, start.batch):
            microbatches = sched.split.ranks[self.dp_rank]
            first = start.microbatch if sched.batch_id == start.batch else 0
            for j in range(first, len(microbatches)):
                indices = [ScheduledIndex(i, sched.loss_denominator, sched.batch_id) for i in microbatches[j]]
                yield self._after(start.epoch, sched.batch_id, j), sched, indices

    def _after(self, epoch: int, batch: int, microbatch: int) -> Position:
        """The position following microbatch ``microbatch`` of ``batch``."""
        if microbatch + 1 < self.n_mb:
            return Position(epoch, batch, microbatch + 1)
        if batch + 1 < self.n_batches(epoch):
            return Position(epoch, batch + 1, 0)
        return Position(epoch + 1, 0, 0)

    def consumed(self, position: Position, schedule: BatchSchedule) -> None:
        """Record that the caller has the microbatch before ``position`` (of ``schedule``)."""
        self.position = position
        self.last_schedule = schedule

    def __iter__(self) -> Iterator[list[ScheduledIndex]]:
        """Yield this rank's microbatches of the rest of the current epoch, then move to the next
        epoch (so a ``RepeatingLoader`` sees a fresh order every epoch).

        The position (:meth:`state_dict`) moves past each microbatch as it is handed out: exact
        for a ``DataLoader`` without workers. Workers fetch ahead of training: use
        :func:`dflop_ds.make_loader`, which moves it only when the caller receives a microbatch.
        """
        for position, sched, indices in self.scheduled_microbatches():
            self.consumed(position, sched)
            yield indices

    # -- checkpointing -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Where the sampler is (the next microbatch to train) and what it schedules: the seed,
        batch sizes and a fingerprint of the dataset's ids and shapes."""
        return {
            "method": self.method,
            "seed": self.seed,
            "epoch": self.position.epoch,
            "next_batch": self.position.batch,
            "next_microbatch": self.position.microbatch,
            "n_samples": len(self.shapes),
            "global_batch_size": self.global_batch_size,
            "drop_last": self.drop_last,
            "gradient_accumulation_steps": self.n_mb,
            "dp_size": self.dp_size,
            "dataset_fingerprint": self.fingerprint,
            "dataset": describe_dataset(self.shapes),
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict`. Refuses a state of another dataset (naming both), seed,
        global batch size or remainder rule; a state taken in the middle of a global batch also
        needs the same sampler, gradient accumulation steps and data-parallel size."""
        mine = self.state_dict()
        if "dataset_fingerprint" in state and state["dataset_fingerprint"] != self.fingerprint:
            raise ValueError(
                f"sampler state is for another dataset: the state's is {state.get('dataset')},"
                f" this sampler's is {mine['dataset']}"
            )
        keys = ["seed", "n_samples", "global_batch_size"] + (["drop_last"] if "drop_last" in state else [])
        if int(state.get("next_microbatch", 0)):
            keys += ["method", "gradient_accumulation_steps", "dp_size"]
        for key in keys:
            if state.get(key) != mine[key]:
                raise ValueError(f"sampler state has {key}={state.get(key)!r}, this sampler has {mine[key]!r}")
        position = Position(int(state["epoch"]), int(state["next_batch"]), int(state.get("next_microbatch", 0)))
        if position.batch >= self.n_batches(position.epoch) or position.microbatch >= self.n_mb:
            raise ValueError(
                f"sampler state points at epoch {position.epoch} batch {position.batch} microbatch"
                f" {position.microbatch}, past the end of that epoch's {self.n_batches(position.epoch)}"
                f" batches of {self.n_mb} microbatches"
            )
        self.position = position
