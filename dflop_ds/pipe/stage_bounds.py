"""Stage splits of a flat layer list: the :class:`StageBounds` value type and the one module that splits.

A split is ``num_stages + 1`` layer-index boundaries (DeepSpeed's ``parts``): stage ``s`` holds
layers ``bounds[s]:bounds[s + 1]``. :class:`StageBounds` checks that once, when it is built.
The splits are registered by name in :data:`STAGE_SPLITS` (:func:`split_stages`): ``min_max``
(exact, over layer costs, optionally under a per-stage memory cap: :func:`min_max_bounds`, the
only min-max splitter of the package), ``measured`` (the same over measured layer seconds) and
``uniform`` (DeepSpeed's own, the stock baseline). Training, the planner, the colocated path and
the benchmarks all split here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import accumulate
from typing import Any

import numpy as np


class StageBounds(tuple[int, ...]):
    """Contiguous, non-empty stages covering all layers: python ints rising strictly from 0.

    Built from any sequence of integers (numpy ints included; DeepSpeed's seeds break on them),
    optionally checked against the model's ``n_layers`` and the pipeline's ``num_stages``; every
    error names the bounds and what is wrong. Immutable; equal to a list or tuple of the same
    ints and shown as one, which is also its JSON form (:meth:`to_list`).
    """

    def __new__(
        cls, bounds: Iterable[Any], *, n_layers: int | None = None, num_stages: int | None = None
    ) -> StageBounds:
        raw = list(bounds)
        if any(isinstance(b, bool) or not isinstance(b, (int, np.integer)) for b in raw):
            raise ValueError(f"stage_bounds {raw} must be integers")
        parts = [int(b) for b in raw]
        if num_stages is not None and len(parts) != num_stages + 1:
            raise ValueError(f"stage_bounds {parts} needs num_stages + 1 = {num_stages + 1} entries")
        if len(parts) < 2:
            raise ValueError(f"stage_bounds {parts} needs at least 2 entries (one stage)")
        if parts[0] != 0:
            raise ValueError(f"stage_bounds {parts} must start at layer 0")
        sizes = [stop - start for start, stop in zip(parts, parts[1:])]
        if min(sizes) < 1:
            raise ValueError(
                f"stage_bounds {parts} are not increasing: stage {sizes.index(min(sizes))} gets no "
                "layers (every stage needs at least one layer)"
            )
        if n_layers is not None and parts[-1] != n_layers:
            raise ValueError(f"stage_bounds {parts} end at layer {parts[-1]}, but the model has {n_layers} layers")
        return super().__new__(cls, parts)

    @classmethod
    def from_sizes(cls, sizes: Iterable[int]) -> StageBounds:
        """The bounds of consecutive stages of ``sizes`` layers each."""
        return cls([0, *accumulate(int(k) for k in sizes)])

    @property
    def num_stages(self) -> int:
        """Stages of the split."""
        return len(self) - 1

    @property
    def n_layers(self) -> int:
        """Layers the split covers."""
        return self[-1]

    def sizes(self) -> list[int]:
        """Layers of every stage."""
        return [stop - start for start, stop in self.ranges()]

    def ranges(self) -> list[tuple[int, int]]:
        """``(start, stop)`` of every stage's layers."""
        return list(zip(self, self[1:]))

    def to_list(self) -> list[int]:
        """The bounds as a plain list (JSON, DeepSpeed's ``parts``)."""
        return list(self)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, tuple)):
            return tuple(self) == tuple(other)
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = tuple.__hash__

    def __repr__(self) -> str:
        return repr(list(self))


def check_stage_count(n_layers: int, num_stages: int) -> None:
    """Raise ``ValueError`` unless ``n_layers`` layers fill ``num_stages`` non-empty stages."""
    if not 1 <= num_stages <= n_layers:
        raise ValueError(f"cannot split {n_layers} layers into {num_stages} non-empty stages")


#: ``stage_memory(stage, lo, hi)``: bytes per GPU of stage ``stage`` holding layers ``lo:hi``,
#: elementwise over numpy arrays of ``lo`` and ``hi`` (broadcast against each other).
StageMemory = Callable[[int, np.ndarray, np.ndarray], Any]


def min_max_bounds(
    layer_costs: Sequence[float],
    num_stages: int,
    *,
    stage_memory: StageMemory | None = None,
    memory_cap: float = float("inf"),
) -> StageBounds | None:
    """The contiguous split of ``layer_costs`` into ``num_stages`` non-empty stages minimising the
    most expensive stage, exactly; with ``stage_memory``, among the splits whose every stage needs at
    most ``memory_cap`` (None when there is none).

    Dynamic programming over (stages, prefix length), O(stages * n^2) vectorised over the prefixes;
    ties go to the split whose later cuts come first (earlier stages shorter), so results are
    deterministic. The one min-max splitter of the package: every cost-balanced split calls it.
    """
    costs = np.asarray([float(c) for c in layer_costs], dtype=float)
    n = costs.size
    check_stage_count(n, num_stages)
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
    lo, hi = np.arange(n + 1)[:, None], np.arange(n + 1)[None, :]
    span = np.where(hi > lo, prefix[hi] - prefix[lo], np.inf)  # span[j, i]: cost of layers j:i
    best = np.full(n + 1, np.inf)  # best[i]: minimal max-stage cost of the first i layers in k stages
    best[0] = 0.0
    cuts = np.zeros((num_stages + 1, n + 1), dtype=np.int64)  # cuts[k, i]: the last cut of that split
    for k in range(1, num_stages + 1):
        value = np.maximum(best[:, None], span)
        if stage_memory is not None:
            value[np.broadcast_to(stage_memory(k - 1, lo, hi), value.shape) > memory_cap] = np.inf
        value[:, :k] = np.inf  # k stages need k layers
        value[:, n - (num_stages - k) + 1 :] = np.inf  # and leave one per later stage
        low = value.min(axis=0)
        cuts[k] = np.argmax(value <= low + 1e-12 * np.maximum(1.0, np.abs(low)), axis=0)
        best = low
    if not np.isfinite(best[n]):
        return None
    bounds = [n]
    for k in range(num_stages, 0, -1):
        bounds.append(int(cuts[k, bounds[-1]]))
    return StageBounds(bounds[::-1])


def uniform_bounds(n_layers: int, num_stages: int) -> StageBounds:
    """DeepSpeed's ``partition_method="uniform"`` (``deepspeed.runtime.utils.partition_uniform``):
    equal layer counts, the remainder one each to the first stages. The stock baseline's split."""
    check_stage_count(n_layers, num_stages)
    size, extra = divmod(n_layers, num_stages)
    return StageBounds.from_sizes(size + (1 if i < extra else 0) for i in range(num_stages))


def _uniform_split(
    layer_costs: Sequence[float],
    num_stages: int,
    *,
    stage_memory: StageMemory | None = None,
    memory_cap: float = float("inf"),
) -> StageBounds | None:
    """:func:`uniform_bounds` of ``len(layer_costs)`` layers (the costs are not read); None when a
    stage needs more than ``memory_cap``."""
    bounds = uniform_bounds(len(layer_costs), num_stages)
    if stage_memory is not None:
        for stage, (lo, hi) in enumerate(bounds.ranges()):
            if float(stage_memory(stage, np.asarray(lo), np.asarray(hi))) > memory_cap:
                return None
    return bounds


#: The stage splits by name (``split_stages``): ``min_max`` over layer costs a cost model predicts,
#: ``measured``: the same exact min-max over layer seconds measured on real microbatches
#: (:func:`dflop_ds.profile.layer_split.measure_layer_costs`), ``uniform``: DeepSpeed's stock split.
STAGE_SPLITS: dict[str, Callable[..., StageBounds | None]] = {
    "min_max": min_max_bounds,
    "measured": min_max_bounds,
    "uniform": _uniform_split,
}


def split_stages(
    method: str,
    layer_costs: Sequence[float],
    num_stages: int,
    *,
    stage_memory: StageMemory | None = None,
    memory_cap: float = float("inf"),
) -> StageBounds | None:
    """The stage bounds ``method`` (a name of :data:`STAGE_SPLITS`) gives for ``layer_costs`` (one per
    layer of the flat list) over ``num_stages`` stages, each within ``memory_cap`` by
    ``stage_memory`` when given (None when no split of that method fits)."""
    if method not in STAGE_SPLITS:
        raise ValueError(f"unknown stage split {method!r}: choose one of {sorted(STAGE_SPLITS)}")
    return STAGE_SPLITS[method](layer_costs, num_stages, stage_memory=stage_memory, memory_cap=memory_cap)


def _cost_split(costs: Sequence[float], num_stages: int) -> list[int]:
    bounds = min_max_bounds(costs, num_stages)
    assert bounds is not None  # no memory cap: every split fits
    return bounds.to_list()


def split_by_cost(
    layer_costs: Sequence[float],
    num_stages: int,
    encoder_stages: int | None = None,
    n_encoder: int | None = None,
) -> StageBounds:
    """Stage boundaries of a contiguous split minimizing the most expensive stage.

    ``layer_costs`` are per-layer costs of the flat list (encoder layers, projector, LLM layers).
    With ``encoder_stages`` (and ``n_encoder``, the number of encoder layers *including* the
    projector), the first ``n_encoder`` layers go onto exactly the first ``encoder_stages``
    stages and the LLM onto the rest; each segment is balanced on its own, which minimizes the
    overall maximum too.
    """
    costs = [float(c) for c in layer_costs]
    if any(c < 0 for c in costs):
        raise ValueError(f"layer costs must be >= 0, got {costs}")
    if encoder_stages is None:
        return StageBounds(_cost_split(costs, num_stages))
    if n_encoder is None:
        raise ValueError("split_by_cost: encoder_stages needs n_encoder (encoder layers + projector)")
    if not 1 <= encoder_stages < num_stages:
        raise ValueError(f"encoder_stages must be in [1, num_stages={num_stages}), got {encoder_stages}")
    if not encoder_stages <= n_encoder <= len(costs) - (num_stages - encoder_stages):
        raise ValueError(
            f"cannot put {n_encoder} encoder layers on {encoder_stages} stages and "
            f"{len(costs) - n_encoder} LLM layers on {num_stages - encoder_stages} stages"
        )
    head = _cost_split(costs[:n_encoder], encoder_stages)
    tail = _cost_split(costs[n_encoder:], num_stages - encoder_stages)
    return StageBounds(head + [n_encoder + b for b in tail[1:]])


def stage_costs(layer_costs: Sequence[float], bounds: Sequence[int]) -> list[float]:
    """Summed cost of every stage of a split."""
    return [float(sum(layer_costs[a:b])) for a, b in zip(bounds, bounds[1:])]


def plan_stage_bounds(
    n_layers: int,
    n_encoder: int,
    num_stages: int,
    *,
    encoder_stages: int | None = None,
    stage_bounds: Sequence[int] | None = None,
    layer_costs: Sequence[float] | None = None,
) -> StageBounds:
    """The split a pipeline of ``n_layers`` layers (the first ``n_encoder`` being encoder +
    projector) should use: ``stage_bounds`` if given (validated, and checked to end the encoder
    after ``encoder_stages`` stages when both are given), else :func:`split_by_cost` over
    ``layer_costs`` (one per layer by default)."""
    if stage_bounds is not None:
        parts = StageBounds(stage_bounds, n_layers=n_layers, num_stages=num_stages)
        if encoder_stages is not None and parts[encoder_stages] != n_encoder:
            raise ValueError(
                f"stage_bounds {parts} do not end the encoder+projector ({n_encoder} layers) "
                f"after encoder_stages={encoder_stages} stages"
            )
        return parts
    costs = [1.0] * n_layers if layer_costs is None else [float(c) for c in layer_costs]
    if len(costs) != n_layers:
        raise ValueError(f"layer_costs has {len(costs)} entries for {n_layers} layers")
    if num_stages == 1:
        if encoder_stages not in (None, 0):
            raise ValueError(f"encoder_stages={encoder_stages} needs more than one stage")
        return StageBounds([0, n_layers])
    return split_by_cost(costs, num_stages, encoder_stages, n_encoder)
