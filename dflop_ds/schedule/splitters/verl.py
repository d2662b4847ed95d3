"""verl's sequence-length balancing, over ranks and then within each rank, as a splitter.

Written from verl's ``verl/utils/seqlen_balancing.py`` and its trainer's ``_balance_batch``
(volcengine/verl, 2026): every sequence's workload is ``24576 * s + s**2`` for its ``s``
attention-mask tokens (for verl's multimodal models, the prompt with its expanded image and
video tokens plus the response: :attr:`SampleShape.llm_tokens`), and

1. ranks: ``get_seqlen_balanced_partitions(workloads, dp, equal_size=True)``, Karmarkar-Karp
   largest differencing with equal counts, partition ``r`` to rank ``r``; each rank's share is
   then ordered by ascending ``(workload, index)`` and laid out small-large-small
   (``part[::2] + part[1::2][::-1]``), which fixes the positions verl's worker sees;
2. microbatches (``use_dynamic_bsz``, verl's ``rearrange_micro_batches``): Karmarkar-Karp over the
   rank's workloads without the equal-count constraint, into as many microbatches as the
   token budget asks, raised to the same count on every data-parallel rank
   (``same_micro_num_in_dp``: an all-reduce of the maximum). DeepSpeed needs that same count as
   its gradient accumulation steps, so here it is the request's ``n_mb`` on every rank (the
   ``max_token_len`` that gives ``n_mb`` on the heaviest rank). The microbatches are sorted by
   ``(summed workload, first position)``, largest first, and laid out with the small ones at
   both ends (``mbs[::2][::-1] + mbs[1::2]``, verl's ``use_dynamic_bsz_balance``).

verl removes padding (``use_remove_padding``), so a microbatch costs the sum of its samples.
Ties break as verl's: sets compare by ``(sum, size, items)``, Karmarkar-Karp states by spread,
then by their largest set. A batch verl would refuse (its size not a multiple of ``dp``) is
filled with empty sequences (workload 0) for the rank step, and they are dropped after.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from dflop_ds.schedule.splitters.base import RankSplit, SplitRequest, SplitResult, register_splitter


def verl_workload(seqlens: Sequence[int] | np.ndarray) -> list[int]:
    """verl's per-sequence workload estimate: ``24576 * s + s**2`` (linear plus attention), exact integers."""
    return [24576 * int(s) + int(s) * int(s) for s in np.asarray(seqlens).tolist()]


class _Set:
    """One growing partition: its summed value and its ``(index, value)`` items in arrival order."""

    __slots__ = ("items", "total")

    def __init__(self) -> None:
        self.total = 0
        self.items: list[tuple[int, int]] = []

    def key(self) -> tuple[int, int, list[tuple[int, int]]]:
        """verl's order of sets: by sum, then size, then items."""
        return self.total, len(self.items), self.items


class _State:
    """``k`` partial partitions, largest first; heap order: largest spread first, then largest top set."""

    __slots__ = ("sets",)

    def __init__(self, items: Sequence[tuple[int, int]], k: int) -> None:
        self.sets = [_Set() for _ in range(k)]
        for target, (index, value) in zip(self.sets, items):
            target.items.append((index, value))
            target.total += value
        self._sort()

    def _sort(self) -> None:
        self.sets.sort(key=_Set.key, reverse=True)

    def spread(self) -> int:
        return self.sets[0].total - self.sets[-1].total

    def __lt__(self, other: _State) -> bool:
        mine, theirs = self.spread(), other.spread()
        if mine != theirs:
            return mine > theirs
        return self.sets[0].key() > other.sets[0].key()

    def absorb(self, other: _State) -> None:
        """Join this state's ``i``-th largest set with ``other``'s ``i``-th smallest."""
        for mine, theirs in zip(self.sets, reversed(other.sets)):
            mine.items.extend(theirs.items)
            mine.total += theirs.total
        self._sort()


def verl_karmarkar_karp(values: Sequence[int] | np.ndarray, n_buckets: int, equal_size: bool = True) -> list[list[int]]:
    """verl's ``get_seqlen_balanced_partitions`` of integer ``values`` into ``n_buckets``: the
    final state's sets, largest first, each as sorted indices. ``equal_size`` starts from the
    ascending values ``n_buckets`` at a time (one per set; their count must divide), otherwise
    from one state per value."""
    values = [int(v) for v in np.asarray(values).tolist()]
    if len(values) < n_buckets:
        raise ValueError(f"verl: {len(values)} sequences cannot fill {n_buckets} partitions")
    if equal_size and len(values) % n_buckets:
        raise ValueError(f"verl: {len(values)} sequences do not divide into {n_buckets} equal partitions")
    ascending = sorted((value, index) for index, value in enumerate(values))
    step = n_buckets if equal_size else 1
    heap: list[_State] = []
    for start in range(0, len(ascending), step):
        heapq.heappush(heap, _State([(i, v) for v, i in ascending[start : start + step]], n_buckets))
    while len(heap) > 1:
        first, second = heapq.heappop(heap), heapq.heappop(heap)
        first.absorb(second)
        heapq.heappush(heap, first)
    return [sorted(index for index, _ in s.items) for s in heap[0].sets]


def rank_shares(workloads: Sequence[int], dp: int) -> list[list[int]]:
    """verl's ``_balance_batch``: each rank's positions, in the order its worker receives them
    (equal-count Karmarkar-Karp, then ascending ``(workload, position)`` laid out small-large-small)."""
    n = len(workloads)
    filled = list(workloads) + [0] * (-n % dp)  # empty sequences fill a batch verl would refuse
    shares = []
    for part in verl_karmarkar_karp(filled, dp, equal_size=True):
        ordered = sorted((p for p in part if p < n), key=lambda p: (filled[p], p))
        shares.append(ordered[::2] + ordered[1::2][::-1])
    return shares


def dynamic_microbatches(workloads: Sequence[int], n_mb: int) -> list[list[int]]:
    """verl's ``rearrange_micro_batches`` of one rank's workloads (in its order) into ``n_mb``
    microbatches: Karmarkar-Karp without equal counts, sorted by ``(workload, first position)``
    largest first, then the small ones at both ends."""
    parts = verl_karmarkar_karp(workloads, n_mb, equal_size=False)
    parts.sort(key=lambda part: (sum(workloads[p] for p in part), part[0]), reverse=True)
    return parts[::2][::-1] + parts[1::2]


def verl_split(seqlens: Sequence[int] | np.ndarray, dp: int, n_mb: int) -> RankSplit:
    """``ranks[r][j]``: positions of rank ``r``'s ``j``-th microbatch under verl's balancing."""
    workloads = verl_workload(seqlens)
    split: RankSplit = []
    for share in rank_shares(workloads, dp):
        micro = dynamic_microbatches([workloads[p] for p in share], n_mb)
        split.append([[share[p] for p in mb] for mb in micro])
    return split


@register_splitter("verl")
class VerlSplitter:
    """verl: Karmarkar-Karp over ranks on the workload of the LLM sequence length (expanded media
    tokens), then each rank's dynamic microbatches, ``n_mb`` on every rank (see the module docstring)."""

    name = "verl"

    def split(self, request: SplitRequest) -> SplitResult:
        """See :func:`verl_split`."""
        seqlens = [s.llm_tokens for s in request.row_shapes(self.name)]
        return request.result(verl_split(seqlens, request.dp, request.n_mb), self.name)
