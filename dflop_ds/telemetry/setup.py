"""The few calls a DeepSpeed training script makes to get telemetry, correction and faults."""

from __future__ import annotations

from dflop_ds.deepspeed_keys import DeepSpeedKeys
from dflop_ds.models.faults import FaultSpec, SlowTiles
from dflop_ds.schedule.correction import CorrectionSettings, CostCorrection


def make_correction(settings: CorrectionSettings, n_stages: int) -> CostCorrection | None:
    """A :class:`CostCorrection` for the ``dflop.correction`` section, or None when it is not enabled."""
    if not settings.enabled:
        return None
    return CostCorrection(settings, n_columns=2, n_stages=n_stages)


def inject_fault(encoder_layers: list, spec: FaultSpec | None, keys: DeepSpeedKeys) -> list:
    """``encoder_layers`` with the first one wrapped in :class:`~dflop_ds.models.faults.SlowTiles`
    when ``dflop.testing.fault`` asks for it (layers may be modules or DeepSpeed ``LayerSpec``);
    ``keys`` (the DeepSpeed config's) give the microbatches per step its ``start_step`` counts in."""
    if spec is None:
        return encoder_layers
    start_call = 0
    if spec.start_step:
        gas = keys.gradient_accumulation_steps
        if not isinstance(gas, int):
            raise ValueError(
                'dflop.testing.fault.start_step needs "gradient_accumulation_steps" in the DeepSpeed config'
            )
        start_call = spec.start_step * gas
    first = encoder_layers[0]
    if hasattr(first, "build"):
        from deepspeed.pipe import LayerSpec

        wrapped = LayerSpec(SlowTiles, first, spec, start_call)
    else:
        wrapped = SlowTiles(first, spec, start_call)
    return [wrapped] + list(encoder_layers[1:])
