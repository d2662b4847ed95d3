"""The memory cap of a microbatch: predicted bytes per sample and per microbatch, oversize samples.

A cost model's ``predict_memory(shapes)`` gives the bytes one microbatch needs beyond the
parameters, per column ``[encoder, llm]``. The cap (``dflop.sampler.memory_cap_bytes``: the
activation bytes one device may hold) bounds their sum: the bytes of a device that holds the
whole model. A cost model whose columns are the bytes of different devices
(``memory_per_device``: :class:`~dflop_ds.cost.StageCost`, one column per pipeline stage, its
share times the microbatches it holds in flight) has the cap bound each column, i.e. their
largest. The partitioner sums per-sample bytes (each sample predicted alone), which is exact or
conservative for packed microbatches (one per-microbatch constant counted per sample; the sum of
per-sample largest columns bounds the largest column of the sum); padded microbatches, which pay
for their longest sample on every row, are checked afterwards with the microbatch prediction (see
:meth:`dflop_ds.schedule.dflop_sampler.DFLOPBatchSampler.balanced_split`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence

import numpy as np

from dflop_ds.cost import CostModel, memory_blind_model
from dflop_ds.shapes import SampleShape

logger = logging.getLogger(__name__)

#: How many offending samples an error or warning names.
NAMED = 5


class OversizeSampleError(ValueError):
    """A sample needs more memory alone than the cap allows any microbatch."""


def memory_predictor(cost_model: CostModel) -> Callable[[Sequence[SampleShape]], np.ndarray]:
    """``cost_model.predict_memory``; a clear error when the model (or one it wraps) predicts no memory."""
    blind = memory_blind_model(cost_model)
    if blind is not None:
        raise ValueError(
            f"a memory cap needs a cost model that predicts memory (predict_memory); {type(blind).__name__} does not"
        )
    return cost_model.predict_memory


def microbatch_bytes(cost_model: CostModel, shapes: Sequence[SampleShape]) -> float:
    """Predicted bytes of one microbatch of ``shapes`` against the cap: the sum of its memory
    columns, or their largest when ``cost_model.memory_per_device`` (columns on different devices)."""
    columns = np.asarray(memory_predictor(cost_model)(list(shapes)), dtype=float)
    return float(columns.max(initial=0.0) if cost_model.memory_per_device else columns.sum())


def sample_bytes(cost_model: CostModel, shapes: Sequence[SampleShape]) -> np.ndarray:
    """``(n,)`` predicted bytes of each sample as a microbatch of its own (equal shapes predicted once)."""
    memo: dict[SampleShape, float] = {}
    out = np.empty(len(shapes))
    for i, shape in enumerate(shapes):
        key = dataclasses.replace(shape, sample_id="")
        if key not in memo:
            memo[key] = microbatch_bytes(cost_model, [shape])
        out[i] = memo[key]
    return out


def oversize_samples(shapes: Sequence[SampleShape], usage: np.ndarray, cap: float, allow_oversize: bool) -> np.ndarray:
    """Indices of the samples predicted above ``cap`` alone.

    Raises:
        OversizeSampleError: naming the first of them (sample id, predicted bytes, cap) unless
            ``allow_oversize``; with it, a warning names them (each is trained alone).
    """
    over = np.flatnonzero(usage > cap)
    if not over.size:
        return over
    named = ", ".join(f"{shapes[i].sample_id!r} ({usage[i]:.4g} bytes)" for i in over[:NAMED])
    more = f" and {over.size - NAMED} more" if over.size > NAMED else ""
    if not allow_oversize:
        raise OversizeSampleError(
            f"sample {named}{more} alone is predicted above the memory cap of {cap:.4g} bytes (from"
            " dflop.sampler.memory_cap_bytes; the run's log says how): it fits in no microbatch. Raise the"
            " cap, drop or shorten the sample, or set dflop.sampler.allow_oversize = true to train it alone"
            " in its own microbatch"
        )
    logger.warning(
        "%d sample(s) are predicted above the memory cap of %.4g bytes alone and are trained each in a"
        " microbatch of its own (allow_oversize): %s%s",
        over.size,
        cap,
        named,
        more,
    )
    return over


def memory_first_fit(
    costs: np.ndarray,
    order_key: np.ndarray,
    n_buckets: int,
    microbatch_memory: Callable[[list[int]], float],
    cap: float,
) -> np.ndarray | None:
    """Bucket labels that keep every bucket's ``microbatch_memory`` within ``cap``, or None.

    Items go largest ``order_key`` (e.g. sequence length) first, each into a bucket it still fits
    into; the last items fill the buckets still empty, so none stays empty. Two rules are tried:
    the least-loaded bucket (summed ``costs``, worst column), which keeps the time balanced, then
    the bucket whose memory grows least (ties: the fullest, a best fit), which groups equal
    lengths, as a padded microbatch needs (its rows all pay for its longest).
    """
    for rule in ("load", "memory"):
        labels = _first_fit(costs, order_key, n_buckets, microbatch_memory, cap, rule)
        if labels is not None:
            return labels
    return None


def _first_fit(
    costs: np.ndarray,
    order_key: np.ndarray,
    n_buckets: int,
    microbatch_memory: Callable[[list[int]], float],
    cap: float,
    rule: str,
) -> np.ndarray | None:
    n = costs.shape[0]
    labels = np.full(n, -1, dtype=np.int64)
    loads = np.zeros((n_buckets, costs.shape[1]))
    used = np.zeros(n_buckets)
    members: list[list[int]] = [[] for _ in range(n_buckets)]
    order = np.argsort(-np.asarray(order_key, dtype=float), kind="stable").tolist()
    for placed, item in enumerate(order):
        empty = [b for b in range(n_buckets) if not members[b]]
        allowed = empty if len(empty) >= n - placed else range(n_buckets)
        best: tuple[float, float, int] | None = None
        for b in allowed:
            size = microbatch_memory(members[b] + [item])
            if size > cap:
                continue
            load = float((loads[b] + costs[item]).max())
            key = (load, 0.0, b) if rule == "load" else (size - used[b], -size, b)
            if best is None or key < best:
                best = key
        if best is None:
            return None
        bucket = best[2]
        size = microbatch_memory(members[bucket] + [item])
        members[bucket].append(item)
        loads[bucket] += costs[item]
        used[bucket] = size
        labels[item] = bucket
    return labels


def fit_under_cap(
    memory: np.ndarray,
    order_key: np.ndarray,
    n_buckets: int,
    microbatch_memory: Callable[[list[int]], float],
    cap: float,
) -> list[list[int]] | None:
    """A split of items ``0..n-1`` into ``n_buckets`` non-empty buckets, each of two or more items
    within ``cap`` by ``microbatch_memory``, or None when none is found.

    Each item whose ``memory`` alone exceeds ``cap`` gets a bucket of its own. The others are
    placed largest ``order_key`` first, by a first fit on their summed ``memory`` (cheap: the
    true bytes of each bucket are then checked once), else by :func:`memory_first_fit`'s memory
    rule. Neither looks at costs, so the answer (and whether there is one) is the same whatever
    costs a training step schedules with. ``microbatch_memory`` must not grow when an item is
    removed (true of padded and packed microbatches), so a fitting bucket may be split.
    """
    usage = np.asarray(memory, dtype=float)
    alone = np.flatnonzero(usage > cap)
    rest = np.flatnonzero(usage <= cap)
    free = n_buckets - alone.size
    if free < 0 or (free == 0 and rest.size) or usage.size < n_buckets:
        return None
    buckets = [[int(i)] for i in alone]
    if not rest.size:
        return buckets

    def rest_memory(positions: list[int]) -> float:
        return microbatch_memory(rest[positions].tolist())

    key = np.asarray(order_key, dtype=float)[rest]
    summed = _summed_first_fit(usage[rest], np.argsort(-key, kind="stable"), free, cap)
    if summed is not None and all(len(b) < 2 or rest_memory(b) <= cap for b in summed):
        return buckets + [rest[b].tolist() for b in summed]
    labels = _first_fit(np.zeros((rest.size, 1)), key, free, rest_memory, cap, "memory")
    if labels is None:
        return None
    return buckets + [rest[labels == b].tolist() for b in range(free)]


def _summed_first_fit(usage: np.ndarray, order: np.ndarray, n_buckets: int, cap: float) -> list[list[int]] | None:
    """Items in ``order`` into the first of ``n_buckets`` buckets whose summed ``usage`` stays
    within ``cap`` (None if one fits nowhere); empty buckets then take half of the fullest."""
    loads = [0.0] * n_buckets
    buckets: list[list[int]] = [[] for _ in range(n_buckets)]
    for item in order.tolist():
        bucket = next((b for b in range(n_buckets) if loads[b] + usage[item] <= cap), None)
        if bucket is None:
            return None
        loads[bucket] += float(usage[item])
        buckets[bucket].append(item)
    for empty in [b for b in range(n_buckets) if not buckets[b]]:
        fullest = max(range(n_buckets), key=lambda b: (len(buckets[b]), -b))
        half = len(buckets[fullest]) // 2
        buckets[empty], buckets[fullest] = buckets[fullest][half:], buckets[fullest][:half]
    return buckets
