"""What every splitter shares: the request it answers, the result it returns, and the registry.

A splitter cuts one global batch into per-rank microbatches: ``ranks[r][j]`` holds the sample
indices of rank ``r``'s ``j``-th microbatch, exactly ``n_mb`` non-empty microbatches per rank,
every sample of the batch exactly once. Splitters are pure functions of their request, so every
rank (and the planner) computes the same split independently. The sampler, the planner's
evaluation and the benchmarks all look splitters up by name here.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from dflop_ds.schedule.group_sums import group_sums
from dflop_ds.schedule.lpt import InfeasibleError
from dflop_ds.shapes import SampleShape
from dflop_ds.sync import SyncModel, as_sync_model, step_cost, step_lower_bound

RankSplit = list[list[list[int]]]
#: A collated microbatch's cost, given the positions (rows of the request) of its samples.
MicrobatchCost = Callable[[Sequence[int]], np.ndarray]
#: A collated microbatch's memory (bytes), given the positions of its samples.
MicrobatchMemory = Callable[[Sequence[int]], float]


class OverBudgetError(InfeasibleError):
    """A split put two or more samples into a microbatch above the request's memory cap."""


@dataclass(frozen=True)
class MemoryBudget:
    """How much memory a microbatch may take.

    Attributes:
        cap: bytes no microbatch of two or more samples may exceed.
        rows: ``(n,)`` predicted bytes of each row of the request; a microbatch takes at least
            their sum.
        microbatch: a microbatch's true (e.g. padded) bytes from row positions; None: the sum
            of its rows.
        allow_oversize: a row over ``cap`` alone gets a microbatch of its own instead of an error.
    """

    cap: float
    rows: np.ndarray
    microbatch: MicrobatchMemory | None = None
    allow_oversize: bool = False

    def __post_init__(self) -> None:
        if not self.cap > 0:
            raise ValueError(f"a memory cap must be > 0 bytes, got {self.cap!r}")
        object.__setattr__(self, "rows", np.asarray(self.rows, dtype=float).reshape(-1))

    def bytes_of(self, positions: Sequence[int]) -> float:
        """Predicted bytes of the microbatch of rows ``positions``."""
        if self.microbatch is not None:
            return float(self.microbatch(positions))
        return float(self.rows[list(positions)].sum())

    def over(self, local: RankSplit) -> list[tuple[list[int], float]]:
        """The microbatches of two or more rows of ``local`` above the cap, with their bytes."""
        sized = ((mb, self.bytes_of(mb)) for rank in local for mb in rank if len(mb) > 1)
        return [(mb, size) for mb, size in sized if size > self.cap]


@dataclass(frozen=True)
class SplitResult:
    """A split with how it was found.

    Attributes:
        ranks: ``ranks[r][j]`` is the sample indices of rank ``r``'s ``j``-th microbatch.
        predicted: ``(dp, n_mb, k)`` predicted cost of each microbatch.
        makespan: the largest predicted microbatch cost over all columns.
        lower_bound: a lower bound on any split's ``step`` (0 when not computed): under a
            pipeline, on the makespan; otherwise :func:`~dflop_ds.sync.step_lower_bound`, which
            knows that a sample cannot be split.
        solver: the method that produced the split.
        step: the predicted step under ``sync`` (:func:`~dflop_ds.sync.step_cost` of
            ``predicted``); under a pipeline, the makespan (the simulator scores pipelines).
        sync: the sync model the request asked for.
    """

    ranks: RankSplit
    predicted: np.ndarray
    makespan: float
    lower_bound: float
    solver: str
    step: float = 0.0
    sync: SyncModel = SyncModel.PIPELINE


@dataclass(frozen=True)
class SplitRequest:
    """One global batch to split, with everything a splitter may read.

    Attributes:
        batch: the dataset indices of the batch (its rows, in the epoch's shuffled order).
        costs: ``(len(batch), k)`` predicted cost of each row (e.g. ``[encoder, llm]`` seconds).
        n_mb: microbatches per data-parallel rank.
        dp: data-parallel ranks.
        shapes: the :class:`SampleShape` of each row, for the splitters that look at lengths
            (LLaVA's, verl's); see :meth:`row_shapes`.
        microbatch_cost: a collated microbatch's true (e.g. padded) cost from row positions;
            None: a microbatch costs the sum of its rows.
        lengths: per-row lengths (e.g. LLM tokens) for padding-aware balancing; None when
            microbatches are packed (no padding).
        seed: seeds the splitters that draw random numbers.
        sync: how the engine's data-parallel ranks meet (:mod:`dflop_ds.sync`; derive it with
            :func:`~dflop_ds.sync.sync_model_of`). The default, ``pipeline``, keeps the
            pre-sync semantics (balance the slowest microbatch, order each rank for 1F1B) for
            callers that do not know the engine; training and planning pass the engine's model.
        memory: the :class:`MemoryBudget` every microbatch must respect (None: no cap).
    """

    batch: Sequence[int]
    costs: np.ndarray
    n_mb: int
    dp: int
    shapes: Sequence[SampleShape] | None = None
    microbatch_cost: MicrobatchCost | None = None
    lengths: Sequence[float] | None = None
    seed: int = 0
    sync: SyncModel = SyncModel.PIPELINE
    memory: MemoryBudget | None = None

    def __post_init__(self) -> None:
        n = len(self.batch)
        if self.n_mb < 1 or self.dp < 1:
            raise ValueError(f"need n_mb >= 1 and dp >= 1, got n_mb={self.n_mb}, dp={self.dp}")
        if n < self.n_mb * self.dp:
            raise ValueError(f"a batch of {n} samples cannot fill {self.n_mb} microbatches on each of {self.dp} ranks")
        if self.shapes is not None and len(self.shapes) != n:
            raise ValueError(f"a batch of {n} samples needs {n} shapes, got {len(self.shapes)}")
        object.__setattr__(self, "costs", np.asarray(self.costs, dtype=float).reshape(n, -1))
        object.__setattr__(self, "sync", as_sync_model(self.sync))
        if self.memory is not None and self.memory.rows.shape != (n,):
            raise ValueError(
                f"a batch of {n} samples needs {n} per-row bytes in its memory budget, got {self.memory.rows.shape}"
            )

    @classmethod
    def of_positions(
        cls, costs: np.ndarray, shapes: Sequence[SampleShape], n_mb: int, dp: int, **options: Any
    ) -> SplitRequest:
        """A request whose batch is the positions ``0..n-1`` of ``shapes`` (the planner's view)."""
        return cls(list(range(len(shapes))), costs, n_mb, dp, shapes=shapes, **options)

    def row_shapes(self, splitter: str) -> Sequence[SampleShape]:
        """The rows' shapes; a clear error naming ``splitter`` when the request has none."""
        if self.shapes is None:
            raise ValueError(f"splitter {splitter!r} reads sample shapes: pass shapes= in the SplitRequest")
        return self.shapes

    def predict(self, local: RankSplit) -> np.ndarray:
        """``(dp, n_mb, k)`` cost of every microbatch of a split over positions."""
        if self.microbatch_cost is not None:
            cost = self.microbatch_cost
            return np.array([[np.asarray(cost(mb), dtype=float) for mb in rank] for rank in local], dtype=float)
        sums = group_sums(self.costs, [mb for rank in local for mb in rank])
        return sums.reshape(len(local), -1, self.costs.shape[1])

    def step(self, predicted: np.ndarray) -> float:
        """The step of a split with microbatch costs ``predicted`` under the request's sync model
        (the makespan under a pipeline)."""
        if self.sync.pipelined:
            return float(predicted.max())
        return step_cost(predicted, self.sync)

    def result(
        self, local: RankSplit, solver: str, predicted: np.ndarray | None = None, lower_bound: float = 0.0
    ) -> SplitResult:
        """The :class:`SplitResult` of a split over positions (``local[r][j]`` = rows of the
        batch), checked to hold every row exactly once in ``n_mb`` non-empty microbatches per
        rank, and within the request's memory budget (an :class:`OverBudgetError` otherwise);
        ``predicted`` defaults to :meth:`predict`. ``lower_bound`` is the makespan bound under a
        pipeline; otherwise the request's own step bound is reported."""
        positions, ends = _checked_positions(local, len(self.batch), self.n_mb, self.dp, solver)
        if self.memory is not None:
            over = self.memory.over(local)
            if over:
                rows, size = over[0]
                raise OverBudgetError(
                    f"splitter {solver!r} put samples {[self.batch[p] for p in rows]} into one microbatch of"
                    f" {size:.4g} bytes, over the memory cap of {self.memory.cap:.4g} bytes"
                    f" ({len(over)} microbatch(es) over it); the dflop splitter keeps to the cap"
                )
        predicted = self.predict(local) if predicted is None else predicted
        microbatches = _pieces(np.asarray(self.batch)[positions].astype(np.int64, copy=False).tolist(), ends)
        ranks = [microbatches[r * self.n_mb : (r + 1) * self.n_mb] for r in range(self.dp)]
        if not self.sync.pipelined:
            lower_bound = step_lower_bound(self.costs, self.dp, self.n_mb, self.sync)
        return SplitResult(
            ranks, predicted, float(predicted.max()), float(lower_bound), solver, self.step(predicted), self.sync
        )


def _flatten(local: RankSplit) -> tuple[np.ndarray, list[int]]:
    """Every position of ``local``, microbatch after microbatch, and where each microbatch ends."""
    microbatches = [mb for rank in local for mb in rank]
    ends = list(itertools.accumulate(map(len, microbatches)))
    count = ends[-1] if ends else 0
    return np.fromiter(itertools.chain.from_iterable(microbatches), dtype=np.int64, count=count), ends


def _pieces(flat: Any, ends: list[int]) -> list[Any]:
    """``flat`` (a list or an array) cut back into its microbatches, the ``i``-th ending at ``ends[i]``."""
    return [flat[start:end] for start, end in zip([0, *ends[:-1]], ends)]


def check_split(local: RankSplit, n_items: int, n_mb: int, dp: int, name: str) -> None:
    """Raise ``ValueError`` naming splitter ``name`` unless ``local`` has ``dp`` ranks of ``n_mb``
    non-empty microbatches holding every position ``0..n_items-1`` exactly once."""
    _checked_positions(local, n_items, n_mb, dp, name)


def _checked_positions(local: RankSplit, n_items: int, n_mb: int, dp: int, name: str) -> tuple[np.ndarray, list[int]]:
    """:func:`check_split`, then ``local``'s positions and microbatch ends (:func:`_flatten`)."""
    if len(local) != dp or any(len(rank) != n_mb for rank in local):
        raise ValueError(
            f"splitter {name!r} returned {[len(rank) for rank in local]} microbatches per rank, "
            f"expected {n_mb} on each of {dp} ranks"
        )
    if any(not mb for rank in local for mb in rank):
        raise ValueError(f"splitter {name!r} returned an empty microbatch")
    positions, ends = _flatten(local)
    if not (
        positions.size == n_items
        and (n_items == 0 or (positions.min() >= 0 and positions.max() < n_items))
        and np.bincount(positions, minlength=n_items).max(initial=0) <= 1
    ):
        raise ValueError(f"splitter {name!r} did not place each of the {n_items} samples exactly once")
    return positions, ends


class Splitter(Protocol):
    """Cuts a global batch into per-rank microbatches (see the module docstring)."""

    name: str

    def split(self, request: SplitRequest) -> SplitResult:
        """The split of ``request``'s batch."""
        ...


_REGISTRY: dict[str, Callable[..., Splitter]] = {}


def register_splitter(name: str) -> Callable[[Callable[..., Splitter]], Callable[..., Splitter]]:
    """Class decorator: make a splitter constructible by ``name`` through :func:`make_splitter`."""

    def register(factory: Callable[..., Splitter]) -> Callable[..., Splitter]:
        if name in _REGISTRY and _REGISTRY[name] is not factory:
            raise ValueError(f"a splitter named {name!r} is already registered")
        _REGISTRY[name] = factory
        return factory

    return register


def splitter_names() -> tuple[str, ...]:
    """Names of the registered splitters, sorted."""
    return tuple(sorted(_REGISTRY))


def make_splitter(name: str, **options: Any) -> Splitter:
    """The splitter registered as ``name``, built with ``options`` (e.g. ``time_limit_s=1.0`` for dflop)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown splitter {name!r}: choose one of {list(splitter_names())}")
    return _REGISTRY[name](**options)
