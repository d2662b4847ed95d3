"""Pipeline stage splits from a cost model, and the per-stage times they imply.

The flat layer list of an :class:`~dflop_ds.pipe.MLLMPipelineModule` is ``encoder layers +
projector + LLM layers``. A cost model predicts the whole encoder (projector included) and the
whole LLM; spreading each evenly over its layers, as the planner does, gives per-layer costs to
split on and per-stage shares of a microbatch's time.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from dflop_ds.pipe.split import split_by_cost
from dflop_ds.shapes import SampleShape


def layer_costs(mean_costs: Sequence[float], encoder_layers: int, llm_layers: int) -> list[float]:
    """Per-layer costs of the flat list: ``mean_costs = [encoder, llm]`` spread over the
    ``encoder_layers + 1`` encoder layers and projector, and over the ``llm_layers``."""
    n_enc = encoder_layers + 1
    return [float(mean_costs[0]) / n_enc] * n_enc + [float(mean_costs[1]) / llm_layers] * llm_layers


def cost_balanced_bounds(cost_model: Any, shapes: Sequence[SampleShape], num_stages: int) -> list[int]:
    """Stage bounds balancing the data's mean predicted per-sample cost across ``num_stages``."""
    mean = np.asarray(cost_model.predict_samples(shapes), dtype=float).mean(axis=0)
    return split_by_cost(layer_costs(mean, cost_model.encoder_layers, cost_model.llm_layers), num_stages)


def stage_shares(bounds: Sequence[int], encoder_layers: int, llm_layers: int) -> np.ndarray:
    """``(num_stages, 2)``: the share of the encoder and of the LLM time each stage holds."""
    n_enc = encoder_layers + 1
    shares = []
    for start, stop in zip(bounds, bounds[1:]):
        enc = max(0, min(stop, n_enc) - start)
        llm = max(0, stop - max(start, n_enc))
        shares.append([enc / n_enc, llm / llm_layers])
    return np.asarray(shares, dtype=float)


def stage_times(microbatch_costs: np.ndarray, shares: np.ndarray) -> np.ndarray:
    """``(m, num_stages)`` stage times from ``(m, 2)`` microbatch ``[encoder, llm]`` times."""
    return np.asarray(microbatch_costs, dtype=float) @ np.asarray(shares, dtype=float).T
