"""The few calls a DeepSpeed training script makes to get telemetry, correction and faults."""

from __future__ import annotations

from typing import Any

from dflop_ds.schedule.correction import CorrectionSettings, CostCorrection
from dflop_ds.testing.faults import FaultSpec, SlowTiles


def make_correction(block: dict[str, Any] | None, n_stages: int) -> CostCorrection | None:
    """A :class:`CostCorrection` for the ``"correction"`` block, or None when it is not enabled."""
    settings = CorrectionSettings.from_dict(block, "dflop.correction")
    if not settings.enabled:
        return None
    return CostCorrection(settings, n_columns=2, n_stages=n_stages)


def inject_fault(encoder_layers: list, block: dict[str, Any] | None, ds_config: dict) -> list:
    """``encoder_layers`` with the first one wrapped in :class:`~dflop_ds.testing.SlowTiles` when
    the ``"fault"`` block asks for it (layers may be modules or DeepSpeed ``LayerSpec``)."""
    spec = FaultSpec.from_dict(block, "dflop.testing.fault")
    if spec is None:
        return encoder_layers
    gas = ds_config.get("gradient_accumulation_steps")
    if spec.start_step and not isinstance(gas, int):
        raise ValueError('dflop.testing.fault.start_step needs "gradient_accumulation_steps" in the DeepSpeed config')
    start_call = spec.start_step * (gas or 1)
    first = encoder_layers[0]
    if hasattr(first, "build"):
        from deepspeed.pipe import LayerSpec

        wrapped = LayerSpec(SlowTiles, first, spec, start_call)
    else:
        wrapped = SlowTiles(first, spec, start_call)
    return [wrapped] + list(encoder_layers[1:])
