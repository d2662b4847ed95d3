"""transformers' ``train_sampling_strategy="batch_rebalance"`` (its ``BatchRebalanceSampler``) as a splitter.

Written from the behaviour of ``transformers.trainer_pt_utils.BatchRebalanceSampler`` (5.x) as the
HF Trainer runs it: one global batch of ``dp * GAS * micro`` samples is sorted by length, longest
first, and cut into ``K = dp * GAS`` contiguous groups whose sizes a hill climb adjusts (one sample
at a time from the costliest group to the cheapest) until the padded costs
``bs * max_len + 0.001 * bs * max_len**2`` stop improving; the groups, costliest first, fill
microbatch slot 0 of every rank, then slot 1, and so on. The cost is fixed (no cost model) and the
length is the sample's token count as the Trainer reads it: ``len(input_ids)`` (its
``_get_train_sampler``, unless the dataset has a length column). The HF processors of
LLaVA-OneVision, Qwen2-VL, InternVL and HF LLaVA expand every image and video into its tokens in
``input_ids``, so the registered ``batch_rebalance`` reads :attr:`SampleShape.llm_tokens`.
``batch_rebalance_text`` reads what LLaVA-1.5's own data code puts there instead: the text and one
``<image>`` placeholder token per image (and per video), the visual tokens being inserted later
inside the model.

What differs from the Trainer: the order of the batch's rows is dflop-ds's epoch shuffle, not
``torch.randperm(seed + epoch)``; given the same rows in the same order, the grouping is the same
(tests/test_batch_rebalance.py compares it with transformers' own sampler). Microbatches per rank
are the plan's ``n_mb`` (the Trainer's gradient accumulation steps).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np
from numpy.typing import ArrayLike

from dflop_ds.schedule.splitters.base import RankSplit, SplitRequest, SplitResult, register_splitter
from dflop_ds.shapes import SampleShape

#: weight of the attention's quadratic term in transformers' fixed cost
QUADRATIC_COST_COEF = 0.001


def padded_group_cost(sizes: ArrayLike, longest: ArrayLike) -> np.ndarray:
    """transformers' cost of groups of ``sizes`` samples padded to ``longest`` tokens:
    ``bs * max_len + 0.001 * bs * max_len**2`` (evaluated in the same order, so ties break alike)."""
    bs = np.asarray(sizes, dtype=np.int64)
    top = np.asarray(longest, dtype=np.int64)
    return (bs * top).astype(float) + QUADRATIC_COST_COEF * bs * top * top


class _Groups:
    """Contiguous groups of the length-sorted batch, described by their sizes."""

    def __init__(self, sorted_lengths: np.ndarray, counts: np.ndarray) -> None:
        self.lengths = sorted_lengths
        self.counts = counts

    def starts(self) -> np.ndarray:
        """Position of each group's first (longest) sample."""
        return np.cumsum(self.counts) - self.counts

    def costs(self) -> np.ndarray:
        """Each group's padded cost; an empty group costs 0."""
        starts = np.minimum(self.starts(), len(self.lengths) - 1)
        costs = padded_group_cost(self.counts, self.lengths[starts])
        return np.where(self.counts > 0, costs, 0.0)


def _slot_of(costs: np.ndarray, pivot: int, dp: int) -> np.ndarray:
    """The groups in ``pivot``'s microbatch slot: ranked by cost (ties by group index), the
    ``dp`` of the same rank block."""
    ranking = np.argsort(-costs, kind="stable")
    block = int(np.flatnonzero(ranking == pivot)[0]) // dp
    return ranking[block * dp : (block + 1) * dp]


def _relieve_and_freeze(groups: _Groups, members: np.ndarray, pivot: int, frozen: np.ndarray, cap: float) -> None:
    """Freeze the slot of ``pivot`` (a one-sample group that cannot shrink), first growing its other
    groups from the cheapest unfrozen groups outside the slot while they stay within ``cap``."""
    outside = ~frozen
    outside[members] = False
    for group in set(members.tolist()):  # a set, visited in CPython's set order as transformers does
        if frozen[group] or group == pivot:
            continue
        while True:
            costs = groups.costs()
            start = int(groups.starts()[group])
            top = int(groups.lengths[start]) if groups.counts[group] > 0 else 0
            if padded_group_cost(groups.counts[group] + 1, top) > cap:
                break
            donors = np.flatnonzero(outside & (groups.counts > 1))
            if donors.size == 0:
                break
            donor = int(donors[np.argmin(costs[donors])])
            groups.counts[group] += 1
            groups.counts[donor] -= 1
    frozen[members] = True


def rebalance_counts(sorted_lengths: np.ndarray, dp: int, n_mb: int) -> np.ndarray:
    """Group sizes of transformers' hill climb over ``sorted_lengths`` (longest first) for
    ``dp * n_mb`` groups: the sizes of the lowest cost spread seen before the climb stops (a state
    seen before, no cheaper group to move to, or the iteration budget ``max(30 K, n)``)."""
    n, k = len(sorted_lengths), dp * n_mb
    if n < k:
        raise ValueError(f"batch_rebalance: {n} samples cannot fill {k} microbatches with one sample each")
    groups = _Groups(sorted_lengths, np.array([n // k + (1 if i < n % k else 0) for i in range(k)], dtype=np.int64))
    frozen = np.zeros(k, dtype=bool)
    seen: set[bytes] = set()
    best_spread, best = float("inf"), groups.counts.copy()
    for _ in range(max(30 * k, n)):
        key = hashlib.blake2b(groups.counts.tobytes(), digest_size=16).digest()
        if key in seen:
            break
        seen.add(key)
        costs = groups.costs()
        active = np.flatnonzero(~frozen)
        if active.size <= 1:
            break
        active_costs = costs[active]
        spread = float(active_costs.max() - active_costs.min())
        if spread < best_spread:
            best_spread, best = spread, groups.counts.copy()
        hi = int(active[np.argmax(active_costs)])
        if costs[hi] == active_costs.min():
            break
        receivers = active[np.argsort(active_costs, kind="stable")]
        receivers = receivers[(receivers != hi) & (costs[receivers] != costs[hi])]
        if groups.counts[hi] > 1 and receivers.size:
            groups.counts[hi] -= 1
            groups.counts[int(receivers[0])] += 1
        elif groups.counts[hi] <= 1:
            _relieve_and_freeze(groups, _slot_of(costs, hi, dp), hi, frozen, float(costs[hi]))
        else:
            break
    return best


def batch_rebalance(lengths: np.ndarray, dp: int, n_mb: int) -> RankSplit:
    """``ranks[r][j]``: positions of rank ``r``'s ``j``-th microbatch under transformers'
    ``BatchRebalanceSampler`` for one global batch of ``lengths`` (in the batch's order)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(-lengths, kind="stable")  # longest first, ties in batch order
    groups = _Groups(lengths[order], rebalance_counts(lengths[order], dp, n_mb))
    bounds = np.concatenate([[0], np.cumsum(groups.counts)])
    members = [order[bounds[g] : bounds[g + 1]].tolist() for g in range(len(groups.counts))]
    ranked = np.argsort(-groups.costs(), kind="stable").tolist()
    return [[members[ranked[slot * dp + r]] for slot in range(n_mb)] for r in range(dp)]


def processor_length(shape: SampleShape) -> int:
    """``len(input_ids)`` of a sample from an HF processor: text plus expanded image and video tokens."""
    return shape.llm_tokens


def placeholder_length(shape: SampleShape) -> int:
    """``len(input_ids)`` of a sample from LLaVA-1.5's data code: text plus one ``<image>`` token
    per image and per video."""
    return shape.text_tokens + len(shape.image_sizes) + (1 if shape.video_frames > 0 else 0)


@register_splitter("batch_rebalance")
class BatchRebalanceSplitter:
    """transformers' ``batch_rebalance`` sampler over the batch, lengths as the Trainer reads them
    from an HF processor's ``input_ids`` (expanded media tokens); microbatches padded-cost
    balanced per slot across ranks."""

    name = "batch_rebalance"
    length: Callable[[SampleShape], int] = staticmethod(processor_length)

    def split(self, request: SplitRequest) -> SplitResult:
        """See :func:`batch_rebalance`."""
        lengths = np.array([self.length(s) for s in request.row_shapes(self.name)], dtype=np.int64)
        return request.result(batch_rebalance(lengths, request.dp, request.n_mb), self.name)


@register_splitter("batch_rebalance_text")
class BatchRebalanceTextSplitter(BatchRebalanceSplitter):
    """``batch_rebalance`` on LLaVA-1.5's placeholder code's ``input_ids`` (text and one
    ``<image>`` token per image or video, visual tokens not counted)."""

    name = "batch_rebalance_text"
    length = staticmethod(placeholder_length)
