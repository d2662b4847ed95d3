"""A cost proxy for when nothing has been profiled: FLOP-proportional, in LLM-token units.

Its memory prediction is analytic: activation bytes kept for backward per transformer layer
and token are ``(17 * hidden + 6 * mlp) * value_bytes / 2`` (Korthikanti et al. 2022, with a
memory-efficient attention that keeps no ``S x S`` scores), summed over the layers; an encoder
tile costs that per patch times the patches of a tile.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from dflop_ds.shapes import SampleShape

if TYPE_CHECKING:
    from dflop_ds.cost.columns import Microbatches


def activation_bytes_per_token(hidden: int, mlp: int, layers: int, value_bytes: int = 2) -> float:
    """Activation bytes one token keeps for backward through ``layers`` transformer blocks."""
    return float(layers * (17 * hidden + 6 * mlp) * value_bytes / 2)


#: The bundled tiny model in fp32: 4-layer, 128-wide LM (MLP 512) and 4-layer, 64-wide ViT (MLP
#: 256) over 64 patches per tile.
TINY_LLM_BYTES_PER_TOKEN = activation_bytes_per_token(128, 512, 4, value_bytes=4)
TINY_ENCODER_BYTES_PER_TILE = 64 * activation_bytes_per_token(64, 256, 4, value_bytes=4)


class ProxyCost:
    """Per-sample costs ``[tile_cost * encoder_tiles, llm_tokens + llm_tokens**2 / attention_span]``.

    Both columns are in the same unit (the linear cost of one LLM token), so that balancing the
    worse of the two, as the partitioner does, is meaningful. It is a
    :class:`~dflop_ds.cost.CostModel`, so the sampler runs before any profiling; profile the
    model for real predictions.

    Args:
        tile_cost: encoder cost of one tile or frame in LLM-token units. The default 16 is about
            the FLOP ratio of the bundled tiny model (64 patches through a 64-wide, 4-layer ViT
            against a 128-wide, 4-layer LM); a SigLIP-400M encoder before a 7B LLM is nearer 40.
        attention_span: sequence length at which the quadratic attention term equals the
            linear one (roughly ``12 * hidden_size`` for a transformer block's FLOPs).
        encoder_bytes_per_tile, llm_bytes_per_token: analytic activation bytes (see the module
            docstring; :func:`activation_bytes_per_token`); the defaults are the tiny model's.
    """

    kind = "proxy"
    # capabilities (:class:`~dflop_ds.cost.CostModel`): padded whole-model costs and analytic bytes;
    # unitless, neither measured nor analytic seconds, so nothing a plan reports as analytic
    additive = False
    per_stage = False
    memory_per_device = False
    predicts_memory = True
    is_analytic = False

    def __init__(
        self,
        tile_cost: float = 16.0,
        attention_span: float = 12 * 128,
        encoder_bytes_per_tile: float = TINY_ENCODER_BYTES_PER_TILE,
        llm_bytes_per_token: float = TINY_LLM_BYTES_PER_TOKEN,
    ) -> None:
        for name, value in (
            ("tile_cost", tile_cost),
            ("attention_span", attention_span),
            ("encoder_bytes_per_tile", encoder_bytes_per_tile),
            ("llm_bytes_per_token", llm_bytes_per_token),
        ):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        self.tile_cost = float(tile_cost)
        self.attention_span = float(attention_span)
        self.encoder_bytes_per_tile = float(encoder_bytes_per_tile)
        self.llm_bytes_per_token = float(llm_bytes_per_token)

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

    def predict_microbatches(self, groups: Microbatches) -> np.ndarray:
        """Costs ``(n, 2)`` of each microbatch of ``groups`` (:meth:`predict_microbatch`, vectorised)."""
        tiles = groups.sums(groups.columns.tiles).astype(float)
        longest = groups.maxima(groups.columns.tokens).astype(float)
        return np.stack([self.tile_cost * tiles, groups.sizes * self._llm(longest)], axis=1)

    def predict_memory(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """Activation bytes ``(2,)`` ``[encoder, llm]`` of one microbatch padded to its longest sequence."""
        if not shapes:
            return np.zeros(2)
        tiles = float(sum(s.encoder_tiles for s in shapes))
        tokens = float(len(shapes) * max(s.llm_tokens for s in shapes))
        return np.array([self.encoder_bytes_per_tile * tiles, self.llm_bytes_per_token * tokens])

    def to_dict(self) -> dict[str, Any]:
        """The constructor parameters (the file's header is :func:`dflop_ds.cost.io.cost_model_to_dict`'s)."""
        return {
            "params": {
                "tile_cost": self.tile_cost,
                "attention_span": self.attention_span,
                "encoder_bytes_per_tile": self.encoder_bytes_per_tile,
                "llm_bytes_per_token": self.llm_bytes_per_token,
            }
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "proxy cost model") -> ProxyCost:
        """Inverse of :meth:`to_dict`; bad parameters are an error naming ``source``."""
        try:
            return cls(**data["params"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{source}: malformed proxy cost model, {type(exc).__name__}: {exc}") from exc
