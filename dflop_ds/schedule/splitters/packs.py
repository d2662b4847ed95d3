"""How a framework's packs (rows of concatenated samples) become DeepSpeed's microbatches.

LLaMA-Factory and ms-swift pack their data set offline into rows; the HF Trainer then samples
rows at random (``RandomSampler``), its loader cuts consecutive ``per_device_train_batch_size``
rows into batches, and accelerate hands loader batch ``b`` to rank ``b % dp``, so rank ``r``'s
``j``-th microbatch of a step is loader batch ``j * dp + r``. :func:`deal_packs` does the same
with one global batch's packs: shuffled by the request's seed, cut into ``dp * n_mb`` consecutive
groups, group ``g`` to rank ``g % dp``, microbatch ``g // dp``.

A step of those frameworks holds a fixed number of rows, not of samples; here the global batch
holds a fixed number of samples, so the rows per microbatch are the batch's packs shared as
evenly as possible (``per_device_train_batch_size`` = packs / microbatches, differing by at most
one); a batch with fewer packs than microbatches (the framework would have filled its step with
more samples) has its fullest packs halved, the first half of their samples in one row and the
rest in another, until every microbatch holds a row.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from dflop_ds.schedule.splitters.base import SplitRequest, SplitResult
from dflop_ds.shapes import SampleShape, split_evenly

Pack = list[int]
#: ``dealt[r][j]``: the packs (each a list of batch positions) of rank ``r``'s ``j``-th microbatch.
DealtPacks = list[list[list[Pack]]]


def default_capacity(lengths: Sequence[int]) -> int:
    """The packing length a user sets when not told: the smallest power of two that holds the
    batch's longest sample (so no sample is truncated or dropped)."""
    return 1 << max(int(max(lengths, default=1)) - 1, 0).bit_length()


def check_fits(shapes: Sequence[SampleShape], lengths: Sequence[int], capacity: int, framework: str) -> None:
    """Raise ``ValueError`` naming the first sample longer than ``capacity`` (``framework`` drops
    or refuses such a sample; here every sample must train)."""
    for shape, length in zip(shapes, lengths):
        if length > capacity:
            raise ValueError(
                f"sample {shape.sample_id!r}: {length} tokens do not fit {framework}'s packing length "
                f"{capacity} (it would drop the sample): raise the packing length"
            )


def halve_fullest(packs: list[Pack], count: int) -> list[Pack]:
    """``packs`` with the pack of the most samples (the first of equals) cut in two, repeatedly,
    until there are ``count``; raises ``ValueError`` when there are fewer samples than ``count``."""
    if sum(len(p) for p in packs) < count:
        raise ValueError(f"{sum(len(p) for p in packs)} samples cannot fill {count} microbatches")
    # each pack keyed by its place in the list: a half extends its parent's key, so keys keep list order
    heap: list[tuple[int, tuple[int, ...], Pack]] = [(-len(pack), (i,), list(pack)) for i, pack in enumerate(packs)]
    heapq.heapify(heap)
    while len(heap) < count:
        _, key, pack = heapq.heappop(heap)
        half = (len(pack) + 1) // 2
        heapq.heappush(heap, (-half, (*key, 0), pack[:half]))
        heapq.heappush(heap, (half - len(pack), (*key, 1), pack[half:]))
    return [pack for _, _, pack in sorted(heap, key=lambda entry: entry[1])]


def deal_packs(packs: Sequence[Pack], dp: int, n_mb: int, seed: int) -> DealtPacks:
    """The Trainer's dealing of ``packs`` to ``dp`` ranks of ``n_mb`` microbatches (module docstring)."""
    count = dp * n_mb
    rows = halve_fullest(list(packs), count)
    shuffled = [rows[i] for i in np.random.default_rng(seed).permutation(len(rows)).tolist()]
    dealt: DealtPacks = [[[] for _ in range(n_mb)] for _ in range(dp)]
    start = 0
    for group, size in enumerate(split_evenly(len(shuffled), count)):
        dealt[group % dp][group // dp] = shuffled[start : start + size]
        start += size
    return dealt


def packed_result(
    request: SplitRequest, packs: Sequence[Pack], lengths: Sequence[int], padded_to: int | None, solver: str
) -> SplitResult:
    """``packs`` of ``request``'s batch dealt by :func:`deal_packs` (the request's seed), each
    microbatch's samples pack after pack, costed by :func:`packed_costs`."""
    dealt = deal_packs(packs, request.dp, request.n_mb, request.seed)
    local = [[[p for pack in mb for p in pack] for mb in rank] for rank in dealt]
    return request.result(local, solver, predicted=packed_costs(request.costs, dealt, lengths, padded_to))


def packed_costs(costs: np.ndarray, dealt: DealtPacks, lengths: Sequence[int], padded_to: int | None) -> np.ndarray:
    """``(dp, n_mb, k)`` cost of each dealt microbatch: the sum of its samples' ``costs``; with
    ``padded_to``, every row padded to that many tokens, the last (LLM) column grown by the
    padding at the microbatch's own cost per token."""
    out = np.zeros((len(dealt), len(dealt[0]), costs.shape[1]))
    for r, rank in enumerate(dealt):
        for j, mb in enumerate(rank):
            positions = [p for pack in mb for p in pack]
            out[r, j] = costs[positions].sum(axis=0)
            tokens = sum(int(lengths[p]) for p in positions)
            if padded_to is not None and tokens > 0:
                out[r, j, -1] *= len(mb) * padded_to / tokens
    return out
