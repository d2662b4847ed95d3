"""Full-depth calibration: the profiled layers, scaled to the full depth, against the whole segment.

The profiler times a few blocks and lets each stand for several (:mod:`dflop_ds.profile.layers`).
A whole segment holds the activations of every layer at once, and on a CPU that makes each
layer slower as the segment gets deeper (3-11% on the tiny MLLM's LLM, five layers against the
three profiled). Calibration runs the whole segment as one connected pass at a few of the
profiled sizes and returns the median ratio of its time to the profiled one; the profiler scales
the segment's times by it. Only sizes whose full-depth activations are no larger than the largest
the profiled layers already held are used, and each parameter's gradient is dropped as soon as it
is accumulated, so calibration needs no more activation memory than profiling and no gradient
memory for the layers profiling did not run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dflop_ds.profile.chain import time_chain
from dflop_ds.profile.timing import Inputs, OutputLoss, robust_statistic

#: where, among the sizes that fit, the calibration sizes sit (fractions of the sorted list)
CALIBRATION_QUANTILES = (0.5, 0.75, 1.0)


@dataclass(frozen=True)
class DepthScale:
    """The factor applied to a segment's profiled times and the evidence for it."""

    factor: float
    ratios: tuple[float, ...]

    def describe(self, segment: str) -> str:
        """One line for the profiler's output."""
        if not self.ratios:
            return f"{segment}: no size small enough to run at full depth; times not calibrated"
        spread = ", ".join(f"{r:.3f}" for r in self.ratios)
        return f"{segment}: full depth / profiled layers x{self.factor:.3f} (median of {spread}); times scaled"


def calibration_points(order: Sequence[int], full_bytes: Sequence[int], budget_bytes: int) -> list[int]:
    """Up to ``len(CALIBRATION_QUANTILES)`` point indices from ``order`` (sorted by size) whose
    full-depth activations ``full_bytes[i]`` are within ``budget_bytes``, spread over the upper half."""
    fitting = [i for i in order if full_bytes[i] <= budget_bytes]
    if not fitting:
        return []
    return list(dict.fromkeys(fitting[round(q * (len(fitting) - 1))] for q in CALIBRATION_QUANTILES))


def _drop_gradient(parameter: torch.Tensor) -> None:
    parameter.grad = None


@contextmanager
def discarded_gradients(layers: Sequence[torch.nn.Module]) -> Iterator[None]:
    """Within the block, every trainable parameter of ``layers`` drops its gradient once accumulated."""
    parameters = {id(p): p for layer in layers for p in layer.parameters() if p.requires_grad}
    handles = [p.register_post_accumulate_grad_hook(_drop_gradient) for p in parameters.values()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def depth_scale(
    layers: Sequence[torch.nn.Module],
    inputs: Sequence[Inputs],
    profiled_seconds: Sequence[float],
    now: Callable[[], float],
    *,
    rounds: int,
    warmup: int,
    statistic: str,
    loss: OutputLoss | None = None,
    bar: Any = None,
) -> DepthScale:
    """Median over the calibration sizes of (whole segment's time) / ``profiled_seconds``.

    ``inputs[k]`` are the segment's first inputs at the ``k``-th calibration size; the whole
    segment runs ``warmup + rounds`` times per size, sizes interleaved in every round.
    """
    if not inputs:
        return DepthScale(1.0, ())
    samples: list[list[float]] = [[] for _ in inputs]
    with discarded_gradients(layers):
        for round_index in range(warmup + rounds):
            for k, first in enumerate(inputs):
                seconds = sum(time_chain(layers, first, now, loss=loss))
                if round_index >= warmup:
                    samples[k].append(seconds)
            if bar is not None:
                bar.update(1)
    ratios = tuple(
        robust_statistic(times, statistic) / max(profiled, 1e-12) for times, profiled in zip(samples, profiled_seconds)
    )
    return DepthScale(float(np.median(ratios)), ratios)


__all__ = ["CALIBRATION_QUANTILES", "DepthScale", "calibration_points", "depth_scale", "discarded_gradients"]
