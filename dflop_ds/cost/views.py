"""The planner's views of a cost model: the same model packed, with its encoder time scaled, or as
DeepSpeed's engine runs it.

A view is a :class:`~dflop_ds.cost.PlannerCostModel` built on one (``cost_model``): it forwards
every attribute and prediction of the model it wraps by name (:class:`PlannerView`) and overrides
only what it changes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from dflop_ds.cost.batched import (
    microbatch_activation_bytes,
    microbatch_costs,
    microbatch_working_bytes,
)
from dflop_ds.cost.columns import Microbatches
from dflop_ds.cost.packed import PackedCost
from dflop_ds.cost.protocol import PlannerCostModel
from dflop_ds.shapes import SampleShape


class PlannerView:
    """``cost_model`` as it is: the base of the views, forwarding each of its planner attributes
    and predictions."""

    def __init__(self, cost_model: PlannerCostModel) -> None:
        self.cost_model = cost_model
        self.additive: bool = cost_model.additive
        self.per_stage: bool = cost_model.per_stage
        self.memory_per_device: bool = cost_model.memory_per_device
        self.predicts_memory: bool = cost_model.predicts_memory
        self.is_analytic: bool = cost_model.is_analytic
        self.encoder_layers: int = cost_model.encoder_layers
        self.llm_layers: int = cost_model.llm_layers
        self.layer_shares: dict[str, list[float]] | None = cost_model.layer_shares
        self.name: str = cost_model.name
        self.param_bytes: Mapping[str, float] = cost_model.param_bytes
        self.hidden_bytes_per_token: float = cost_model.hidden_bytes_per_token
        self.encoder_hidden_bytes_per_token: float = cost_model.encoder_hidden_bytes_per_token
        self.activation_checkpointing: bool = cost_model.activation_checkpointing
        self.tensor_parallel_layers: bool = cost_model.tensor_parallel_layers
        self.forward_fraction: float = cost_model.forward_fraction
        self.gpu_memory_bytes: float | None = cost_model.gpu_memory_bytes

    def predict_samples(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """The wrapped model's per-sample ``[encoder, llm]``."""
        return self.cost_model.predict_samples(shapes)

    def predict_microbatch(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """The wrapped model's microbatch ``[encoder, llm]``."""
        return self.cost_model.predict_microbatch(shapes)

    def predict_memory(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """The wrapped model's microbatch bytes."""
        return self.cost_model.predict_memory(shapes)

    def predict_activation_bytes(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """The wrapped model's kept activation bytes."""
        return self.cost_model.predict_activation_bytes(shapes)

    def predict_working_bytes(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """The wrapped model's transient bytes."""
        return self.cost_model.predict_working_bytes(shapes)

    def predict_microbatches(self, groups: Microbatches) -> np.ndarray:
        """The wrapped model's ``[encoder, llm]`` of each microbatch of ``groups``."""
        return microbatch_costs(self.cost_model, groups)

    def predict_microbatches_activation_bytes(self, groups: Microbatches) -> np.ndarray:
        """The wrapped model's kept bytes of each microbatch of ``groups``."""
        return microbatch_activation_bytes(self.cost_model, groups)

    def predict_microbatches_working_bytes(self, groups: Microbatches) -> np.ndarray:
        """The wrapped model's transient bytes of each microbatch of ``groups``."""
        return microbatch_working_bytes(self.cost_model, groups)


class PackedView(PlannerView):
    """``cost_model`` for packed microbatches: time and memory from :class:`~dflop_ds.cost.PackedCost`,
    kept and working bytes the sum of the samples' (no padding)."""

    def __init__(self, cost_model: PlannerCostModel) -> None:
        super().__init__(cost_model)
        self.packed = PackedCost(cost_model)
        self.additive = self.packed.additive

    def predict_samples(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """Marginal ``[encoder, llm]`` seconds of each sample in a packed microbatch."""
        return self.packed.predict_samples(shapes)

    def predict_microbatch(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """Seconds of one packed microbatch."""
        return self.packed.predict_microbatch(shapes)

    def predict_memory(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """Bytes of one packed microbatch."""
        return self.packed.predict_memory(shapes)

    def predict_activation_bytes(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """Kept bytes of a packed microbatch: its samples' own."""
        return _summed(self.cost_model.predict_activation_bytes, shapes)

    def predict_working_bytes(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """Transient bytes of a packed microbatch: its samples' own."""
        return _summed(self.cost_model.predict_working_bytes, shapes)

    def predict_microbatches(self, groups: Microbatches) -> np.ndarray:
        """Seconds of each packed microbatch of ``groups``."""
        return self.packed.predict_microbatches(groups)

    def predict_microbatches_activation_bytes(self, groups: Microbatches) -> np.ndarray:
        """Kept bytes of each packed microbatch of ``groups``: its samples' own."""
        return groups.sums(microbatch_activation_bytes(self.cost_model, Microbatches.singletons(groups.columns)))

    def predict_microbatches_working_bytes(self, groups: Microbatches) -> np.ndarray:
        """Transient bytes of each packed microbatch of ``groups``: its samples' own."""
        return groups.sums(microbatch_working_bytes(self.cost_model, Microbatches.singletons(groups.columns)))


def _summed(predict: Callable[[Sequence[SampleShape]], np.ndarray], shapes: Sequence[SampleShape]) -> np.ndarray:
    return np.sum([np.asarray(predict([s]), dtype=float) for s in shapes], axis=0) if shapes else np.zeros(2)


class ColumnScaled(PlannerView):
    """``cost_model`` with its ``[encoder, llm]`` seconds multiplied by ``scale`` (memory unchanged)."""

    def __init__(self, cost_model: PlannerCostModel, scale: Sequence[float] | np.ndarray) -> None:
        super().__init__(cost_model)
        self.scale = np.asarray(scale, dtype=float)

    def predict_samples(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """The wrapped model's per-sample seconds, scaled."""
        return np.asarray(self.cost_model.predict_samples(shapes), dtype=float) * self.scale

    def predict_microbatch(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """The wrapped model's microbatch seconds, scaled."""
        return np.asarray(self.cost_model.predict_microbatch(shapes), dtype=float) * self.scale

    def predict_microbatches(self, groups: Microbatches) -> np.ndarray:
        """The wrapped model's seconds of each microbatch of ``groups``, scaled."""
        return np.asarray(microbatch_costs(self.cost_model, groups), dtype=float) * self.scale


class EncoderScaled(ColumnScaled):
    """``cost_model`` with its encoder seconds multiplied by ``factor`` (memory unchanged)."""

    def __init__(self, cost_model: PlannerCostModel, factor: float) -> None:
        super().__init__(cost_model, [float(factor), 1.0])
        self.factor = float(factor)
        self.name = f"{cost_model.name} (encoder time x{self.factor:.3g})"


class EngineScaled(ColumnScaled):
    """``cost_model`` as DeepSpeed's engine runs it (an engine profile,
    :class:`~dflop_ds.plan.engine_profile.EngineProfile`): predictions times the in-engine
    multipliers ``compute_scale``, the measured ``forward_fraction``."""

    def __init__(
        self, cost_model: PlannerCostModel, compute_scale: Sequence[float] | np.ndarray, forward_fraction: float
    ) -> None:
        super().__init__(cost_model, compute_scale)
        self.forward_fraction = float(forward_fraction)
