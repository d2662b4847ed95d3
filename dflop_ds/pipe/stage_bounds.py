"""Stage splits of a flat layer list: cost-balanced contiguous splits and their validation.

A split is a list of ``num_stages + 1`` layer-index boundaries (DeepSpeed's ``parts``): stage
``s`` holds layers ``bounds[s]:bounds[s + 1]``. Pure functions on lists of numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate


def _min_max_split(costs: Sequence[float], num_stages: int) -> list[int]:
    """Contiguous split of ``costs`` into ``num_stages`` non-empty parts minimizing the largest sum.

    Dynamic programming over (stages, prefix length), O(stages * n^2); ties go to the split
    whose earlier stages are shortest, so results are deterministic.
    """
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot split {n} layers into {num_stages} non-empty stages")
    prefix = [0.0, *accumulate(float(c) for c in costs)]
    inf = float("inf")
    # best[k][i]: minimal max-stage cost of the first i layers in k stages; cut[k][i]: last boundary
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i] - 1e-12 * max(1.0, abs(value)):
                    best[k][i], cut[k][i] = value, j
    bounds = [n]
    for k in range(num_stages, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


def split_by_cost(
    layer_costs: Sequence[float],
    num_stages: int,
    encoder_stages: int | None = None,
    n_encoder: int | None = None,
) -> list[int]:
    """Stage boundaries of a contiguous split minimizing the most expensive stage.

    ``layer_costs`` are per-layer costs of the flat list (encoder layers, projector, LLM layers).
    With ``encoder_stages`` (and ``n_encoder``, the number of encoder layers *including* the
    projector), the first ``n_encoder`` layers go onto exactly the first ``encoder_stages``
    stages and the LLM onto the rest; each segment is balanced on its own, which minimizes the
    overall maximum too. Returns ``num_stages + 1`` python ints from 0 to ``len(layer_costs)``.
    """
    costs = [float(c) for c in layer_costs]
    if any(c < 0 for c in costs):
        raise ValueError(f"layer costs must be >= 0, got {costs}")
    if encoder_stages is None:
        return _min_max_split(costs, num_stages)
    if n_encoder is None:
        raise ValueError("split_by_cost: encoder_stages needs n_encoder (encoder layers + projector)")
    if not 1 <= encoder_stages < num_stages:
        raise ValueError(f"encoder_stages must be in [1, num_stages={num_stages}), got {encoder_stages}")
    if not encoder_stages <= n_encoder <= len(costs) - (num_stages - encoder_stages):
        raise ValueError(
            f"cannot put {n_encoder} encoder layers on {encoder_stages} stages and "
            f"{len(costs) - n_encoder} LLM layers on {num_stages - encoder_stages} stages"
        )
    head = _min_max_split(costs[:n_encoder], encoder_stages)
    tail = _min_max_split(costs[n_encoder:], num_stages - encoder_stages)
    return head + [n_encoder + b for b in tail[1:]]


def check_stage_bounds(bounds: Sequence[int], n_layers: int, num_stages: int) -> list[int]:
    """Validate a split and return it as python ints (DeepSpeed seeds break on numpy ints)."""
    parts = [int(b) for b in bounds]
    if len(parts) != num_stages + 1:
        raise ValueError(f"stage_bounds needs num_stages + 1 = {num_stages + 1} entries, got {parts}")
    if parts[0] != 0 or parts[-1] != n_layers:
        raise ValueError(f"stage_bounds must run from 0 to {n_layers} layers, got {parts}")
    if any(stop <= start for start, stop in zip(parts, parts[1:])):
        raise ValueError(f"every stage needs at least one layer: stage_bounds {parts} are not increasing")
    return parts


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
) -> list[int]:
    """The split a pipeline of ``n_layers`` layers (the first ``n_encoder`` being encoder +
    projector) should use: ``stage_bounds`` if given (validated, and checked to end the encoder
    after ``encoder_stages`` stages when both are given), else :func:`split_by_cost` over
    ``layer_costs`` (one per layer by default)."""
    if stage_bounds is not None:
        parts = check_stage_bounds(stage_bounds, n_layers, num_stages)
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
        return [0, n_layers]
    return check_stage_bounds(split_by_cost(costs, num_stages, encoder_stages, n_encoder), n_layers, num_stages)
