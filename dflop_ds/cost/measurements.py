"""What the model profiler measured: the data a fitted cost model is fitted on (and stores).

:func:`dflop_ds.profile.profile_model` produces a :class:`ModelProfile`; the fitted cost model
(:class:`dflop_ds.cost.FittedCostModel`) keeps it for its planner attributes and its file.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Measurement:
    """Full-depth measurements of one segment at one input size.

    ``tiles`` is set for the encoder, ``batch`` and ``seq_len`` for the LLM; ``attention_units``
    for an encoder whose input factory knows its attention windows (the sum over windows of
    their squared units, see ``SampleShape.encoder_attention``). Times are robust
    seconds of forward+backward; ``attention_s`` is ``None`` when no attention call was seen.
    ``peak_bytes`` is ``None`` when the platform cannot measure peak memory.
    """

    time_s: float
    attention_s: float | None
    activation_bytes: int
    peak_bytes: int | None
    tiles: int = 0
    batch: int = 1
    seq_len: int = 0
    attention_units: int | None = None


@dataclass
class ModelProfile:
    """Measurements of an encoder and an LLM segment, scaled to their full depths.

    ``layer_shares`` (``None`` in profiles of older versions): each layer's measured share of its
    segment's time, ``"encoder"`` over the encoder layers plus the projector slot (last),
    ``"llm"`` over the LLM layers.
    """

    encoder: list[Measurement]
    llm: list[Measurement]
    encoder_layers: int
    llm_layers: int
    param_bytes: dict[str, int]
    hidden_bytes_per_token: float
    meta: dict[str, Any] = field(default_factory=dict)
    layer_shares: dict[str, list[float]] | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict."""
        data = asdict(self)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelProfile:
        """Inverse of :meth:`to_dict`."""
        try:
            return cls(
                encoder=[Measurement(**m) for m in data["encoder"]],
                llm=[Measurement(**m) for m in data["llm"]],
                encoder_layers=int(data["encoder_layers"]),
                llm_layers=int(data["llm_layers"]),
                param_bytes={k: int(v) for k, v in data["param_bytes"].items()},
                hidden_bytes_per_token=float(data["hidden_bytes_per_token"]),
                meta=dict(data.get("meta", {})),
                layer_shares=_read_layer_shares(data.get("layer_shares")),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed model profile: {exc}") from exc


def _read_layer_shares(data: Any) -> dict[str, list[float]] | None:
    if data is None:
        return None
    return {"encoder": [float(x) for x in data["encoder"]], "llm": [float(x) for x in data["llm"]]}
