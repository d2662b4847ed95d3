"""DFLOP's split: balanced microbatches from the partitioner, assigned and ordered onto ranks.

:class:`DFLOPSplitter` is registered as ``"dflop"``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from dflop_ds.schedule import partition as partitioner
from dflop_ds.schedule.lpt import MicrobatchCost
from dflop_ds.schedule.ranks import assign_to_ranks, lockstep_order
from dflop_ds.schedule.splitters.base import SplitRequest, SplitResult, register_splitter

logger = logging.getLogger(__name__)
#: Suffix of ``SplitResult.solver`` when the exact solver failed and the heuristic answered.
FALLBACK_SUFFIX = "+fallback"
_warned_fallback: set[str] = set()


@register_splitter("dflop")
class DFLOPSplitter:
    """Partition the batch into ``n_mb * dp`` microbatches minimising the slowest one on every
    cost column (encoder and LLM), assign them to ranks evenly, order each rank's microbatches
    to shorten pipeline fill and drain.

    ``lockstep`` is for engines without a pipeline whose data-parallel ranks synchronise in every
    microbatch (ZeRO): a microbatch then costs the sum of its columns (encoder and LLM run one
    after the other), and microbatch ``k`` of every rank gets a similar cost
    (:func:`~dflop_ds.schedule.ranks.lockstep_order`); ``predicted`` has one column.

    The request's ``microbatch_cost`` gives a microbatch's true (e.g. padded) cost; its
    ``lengths`` enable the padding-aware starts when that cost pads to the longest sample.
    ``time_limit_s`` and ``node_limit`` bound the exact solver (both 0: heuristic only). Ranks
    computing the split independently need a deterministic answer: no time limit (the
    heuristic, or the ILP within ``node_limit`` nodes).
    """

    name = "dflop"

    def __init__(self, time_limit_s: float = 0.0, node_limit: int = 0, lockstep: bool = False) -> None:
        self.time_limit_s = float(time_limit_s)
        self.node_limit = int(node_limit)
        self.lockstep = bool(lockstep)

    def split(
        self,
        request: SplitRequest,
        *,
        memory: np.ndarray | None = None,
        memory_cap: float | None = None,
        allow_oversize: bool = False,
        microbatch_memory: Callable[[list[int]], float] | None = None,
    ) -> SplitResult:
        """The balanced split of ``request``'s batch.

        ``memory`` (bytes per batch row), ``memory_cap``, ``allow_oversize`` and
        ``microbatch_memory`` go to :func:`~dflop_ds.schedule.partition.partition_batch`: no
        microbatch's summed memory above the cap.
        """
        cost_matrix, microbatch_cost = self._costs(request)
        lengths = None if request.lengths is None else np.asarray(request.lengths, float)
        partition, solver = _partition_or_fallback(
            cost_matrix,
            request.n_mb * request.dp,
            self.time_limit_s,
            self.node_limit,
            seed=request.seed,
            microbatch_cost=microbatch_cost,
            lengths=lengths,
            memory=None if memory is None else np.asarray(memory, float),
            memory_cap=memory_cap,
            allow_oversize=allow_oversize,
            microbatch_memory=microbatch_memory,
        )
        return self._onto_ranks(request, partition, solver)

    def split_buckets(self, request: SplitRequest, buckets: list[list[int]], solver: str) -> SplitResult:
        """``request``'s batch split into the given ``n_mb * dp`` microbatches (lists of batch rows),
        assigned and ordered onto ranks as :meth:`split` does."""
        cost_matrix, microbatch_cost = self._costs(request)
        partition = partitioner.partition_from_buckets(cost_matrix, buckets, solver, microbatch_cost)
        return self._onto_ranks(request, partition, solver)

    def _costs(self, request: SplitRequest) -> tuple[np.ndarray, MicrobatchCost | None]:
        """The cost matrix and microbatch cost the partitioner balances (summed columns in lockstep)."""
        cost_matrix = request.costs
        microbatch_cost = request.microbatch_cost
        if self.lockstep:
            cost_matrix = cost_matrix.sum(axis=1, keepdims=True)
            if microbatch_cost is not None:
                columns = microbatch_cost
                microbatch_cost = lambda positions: np.atleast_1d(np.asarray(columns(positions), dtype=float).sum())  # noqa: E731
        return cost_matrix, microbatch_cost

    def _onto_ranks(self, request: SplitRequest, partition: Any, solver: str) -> SplitResult:
        """Assign ``partition``'s microbatches to ranks and order them (costs as the partitioner measured them)."""
        assign = lockstep_order if self.lockstep else assign_to_ranks
        order = assign(partition.bucket_costs, request.dp, request.n_mb)
        local = [[partition.buckets[b] for b in rank] for rank in order]  # result() copies them
        predicted = partition.bucket_costs[np.asarray(order)]
        return request.result(local, solver, predicted, float(partition.lower_bound))


def _partition_or_fallback(
    cost_matrix: np.ndarray, n_buckets: int, time_limit_s: float, node_limit: int = 0, **options: Any
):
    """``partition_batch``, falling back to its heuristic alone when the exact solver fails.

    Bad input (a ``ValueError``, e.g. a negative or NaN cost) is raised as is. Any other error
    with the solver enabled (a PuLP error, a missing CBC binary, an OS error starting it) is
    logged once per error type and answered by the deterministic heuristic; ``solver`` then
    ends in :data:`FALLBACK_SUFFIX`. ``options`` go to ``partition_batch`` as they are.
    Returns ``(partition, solver)``.
    """
    try:
        partition = partitioner.partition_batch(
            cost_matrix, n_buckets, time_limit_s=time_limit_s, node_limit=node_limit, **options
        )
        return partition, partition.solver
    except ValueError:
        raise
    except Exception as error:  # noqa: BLE001 - any solver failure must not stop training
        if time_limit_s <= 0 and node_limit <= 0:
            raise
        kind = type(error).__name__
        if kind not in _warned_fallback:
            _warned_fallback.add(kind)
            logger.warning(
                "exact partition solver failed (%s: %s); using the heuristic split instead "
                "(logged once per error type)",
                kind,
                error,
            )
    partition = partitioner.partition_batch(cost_matrix, n_buckets, time_limit_s=0.0, **options)
    return partition, partition.solver + FALLBACK_SUFFIX
