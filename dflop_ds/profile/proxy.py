"""A cost proxy for when nothing has been profiled: FLOP-proportional, in LLM-token units."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from dflop_ds.shapes import SampleShape


class ProxyCost:
    """Per-sample costs ``[tile_cost * encoder_tiles, llm_tokens + llm_tokens**2 / attention_span]``.

    Both columns are in the same unit (the linear cost of one LLM token), so that balancing the
    worse of the two, as the partitioner does, is meaningful. It has the prediction interface of
    :class:`dflop_ds.profile.CostModel`, so the sampler runs before any profiling; profile the
    model for real predictions.

    Args:
        tile_cost: encoder cost of one tile or frame in LLM-token units. The default 16 is about
            the FLOP ratio of the bundled tiny model (64 patches through a 64-wide, 4-layer ViT
            against a 128-wide, 4-layer LM); a SigLIP-400M encoder before a 7B LLM is nearer 40.
        attention_span: sequence length at which the quadratic attention term equals the
            linear one (roughly ``12 * hidden_size`` for a transformer block's FLOPs).
    """

    def __init__(self, tile_cost: float = 16.0, attention_span: float = 12 * 128) -> None:
        if tile_cost <= 0:
            raise ValueError(f"tile_cost must be > 0, got {tile_cost}")
        if attention_span <= 0:
            raise ValueError(f"attention_span must be > 0, got {attention_span}")
        self.tile_cost = float(tile_cost)
        self.attention_span = float(attention_span)

    def _llm(self, tokens: np.ndarray) -> np.ndarray:
        return tokens + tokens**2 / self.attention_span

    def predict_samples(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """Per-sample ``(n, 2)`` costs ``[encoder, llm]``."""
        tiles = np.array([s.encoder_tiles for s in shapes], dtype=float)
        tokens = np.array([s.llm_tokens for s in shapes], dtype=float)
        return np.stack([self.tile_cost * tiles, self._llm(tokens)], axis=1).reshape(-1, 2)

    def predict_microbatch(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """Cost ``(2,)`` of one microbatch padded to its longest sequence."""
        if not shapes:
            return np.zeros(2)
        longest = float(max(s.llm_tokens for s in shapes))
        tiles = float(sum(s.encoder_tiles for s in shapes))
        return np.array([self.tile_cost * tiles, len(shapes) * self._llm(np.array(longest))])
