"""The memory cap of a microbatch: predicted bytes per sample and per microbatch, oversize samples.

A cost model's ``predict_memory(shapes)`` gives the bytes one microbatch needs beyond the
parameters, per column ``[encoder, llm]``. The cap bounds their sum: the bytes of a device that
holds the whole model (exact for the plain engine; conservative for a pipeline stage, which holds
a part of the layers). The partitioner sums per-sample bytes (each sample predicted alone), which
is exact or conservative for packed microbatches (one per-microbatch constant counted per sample);
padded microbatches, which pay for their longest sample on every row, are checked afterwards with
the microbatch prediction (see :meth:`dflop_ds.schedule.sampler.DFLOPBatchSampler.balanced_split`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from dflop_ds.shapes import SampleShape

logger = logging.getLogger(__name__)

#: How many offending samples an error or warning names.
NAMED = 5


class OversizeSampleError(ValueError):
    """A sample needs more memory alone than the cap allows any microbatch."""


def memory_predictor(cost_model: Any) -> Any:
    """``cost_model.predict_memory``; a clear error when the model predicts no memory."""
    predict = getattr(cost_model, "predict_memory", None)
    if predict is None:
        raise ValueError(
            f"a memory cap needs a cost model that predicts memory (predict_memory);"
            f" {type(cost_model).__name__} does not"
        )
    return predict


def microbatch_bytes(cost_model: Any, shapes: Sequence[SampleShape]) -> float:
    """Predicted bytes of one microbatch of ``shapes``: the sum of its memory columns."""
    return float(np.sum(memory_predictor(cost_model)(list(shapes))))


def sample_bytes(cost_model: Any, shapes: Sequence[SampleShape]) -> np.ndarray:
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
            f'sample {named}{more} alone is predicted above "dflop".memory_cap_bytes = {cap:.4g} bytes: it fits in'
            ' no microbatch. Raise the cap, drop or shorten the sample, or set "dflop".allow_oversize = true to'
            " train it alone in its own microbatch"
        )
    logger.warning(
        "%d sample(s) are predicted above memory_cap_bytes = %.4g bytes alone and are trained each in a"
        " microbatch of its own (allow_oversize): %s%s",
        over.size,
        cap,
        named,
        more,
    )
    return over
