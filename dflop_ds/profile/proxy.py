"""A cost proxy for when nothing has been profiled: tiles for the encoder, tokens for the LLM."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from dflop_ds.shapes import SampleShape


class ProxyCost:
    """Unitless per-sample costs: ``[encoder_tiles, llm_tokens + llm_tokens**2 / attention_span]``.

    It has the prediction interface of :class:`dflop_ds.profile.CostModel`, so the sampler and
    the partitioner run before any profiling; the two columns are not comparable with each
    other, which is fine for balancing each column separately.

    Args:
        attention_span: sequence length at which the quadratic attention term equals the
            linear one (roughly ``12 * hidden_size`` for a transformer block's FLOPs).
    """

    def __init__(self, attention_span: float = 12 * 128) -> None:
        if attention_span <= 0:
            raise ValueError(f"attention_span must be > 0, got {attention_span}")
        self.attention_span = float(attention_span)

    def predict_samples(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """Per-sample ``(n, 2)`` costs ``[encoder, llm]``."""
        tiles = np.array([s.encoder_tiles for s in shapes], dtype=float)
        tokens = np.array([s.llm_tokens for s in shapes], dtype=float)
        return np.stack([tiles, tokens + tokens**2 / self.attention_span], axis=1).reshape(-1, 2)

    def predict_microbatch(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """Cost ``(2,)`` of one microbatch padded to its longest sequence."""
        if not shapes:
            return np.zeros(2)
        longest = max(s.llm_tokens for s in shapes)
        tiles = float(sum(s.encoder_tiles for s in shapes))
        return np.array([tiles, len(shapes) * (longest + longest**2 / self.attention_span)])
