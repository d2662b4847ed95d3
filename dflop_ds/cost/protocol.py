"""The cost-model protocols: what every cost model predicts and declares, and what more the
stage split and the planner read.

A cost model's capabilities are declared, never probed: every cost model has the flags of
:class:`CostModel` (a wrapper forwards its inner model's, changing only what it changes); a model
that knows its architecture is a :class:`LayeredCostModel`, one the planner can search with a
:class:`PlannerCostModel`; one that predicts many microbatches in one call is a
:class:`BatchedCostModel` (:class:`BatchedPlannerCostModel` with its bytes too), one that costs a
batch's microbatches from their positions a :class:`PositionalCostModel`. Check them with
``isinstance`` (the protocols are runtime-checkable).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from dflop_ds.shapes import SampleShape

if TYPE_CHECKING:
    from dflop_ds.cost.columns import Microbatches


@runtime_checkable
class CostModel(Protocol):
    """Predicted cost of samples and microbatches in columns ``[encoder, llm]`` (one column per
    pipeline stage where ``per_stage``), and the capabilities the scheduler relies on.

    Implemented by :class:`~dflop_ds.cost.FittedCostModel` (profiled, seconds),
    :class:`~dflop_ds.cost.AnalyticMLLM` (FLOP counts, seconds), :class:`~dflop_ds.cost.ProxyCost`
    (unitless LLM-token equivalents, analytic bytes) and the wrappers of :mod:`dflop_ds.cost`
    (:class:`~dflop_ds.cost.PackedCost`, :class:`~dflop_ds.cost.LLMOnlyCost`,
    :class:`~dflop_ds.cost.StageCost`, the planner's views). The file kinds also have a class
    attribute ``kind`` (their name in a cost-model file, :mod:`dflop_ds.cost.io`) and
    ``to_dict`` / ``from_dict`` for their state.
    """

    @property
    def additive(self) -> bool:
        """A microbatch costs the sum of its samples' costs plus a constant (packed): the sampler
        needs no padding-aware microbatch cost."""
        ...

    @property
    def per_stage(self) -> bool:
        """The columns are pipeline stages, not ``[encoder, llm]`` (telemetry pairs stage ``s`` with column ``s``)."""
        ...

    @property
    def memory_per_device(self) -> bool:
        """:meth:`predict_memory`'s columns are bytes of different devices: a cap bounds each, not their sum."""
        ...

    @property
    def predicts_memory(self) -> bool:
        """:meth:`predict_memory` predicts bytes (False: it raises, e.g. under a colocated encoder)."""
        ...

    @property
    def is_analytic(self) -> bool:
        """Built from FLOP counts and stated formulas, not measured."""
        ...

    def predict_samples(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """``(n, k)``: each sample's cost as a microbatch of its own, over the full depth."""
        ...

    def predict_microbatch(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """``(k,)``: the cost of one microbatch of ``shapes`` as the model runs it (padded or packed)."""
        ...

    def predict_memory(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """``(k,)``: bytes one microbatch of ``shapes`` needs beyond the parameters (activations kept
        for backward and the transient peak), per column over the full depth."""
        ...


@runtime_checkable
class CostWrapper(CostModel, Protocol):
    """A cost model built on another one, ``cost_model``, whose predictions it transforms."""

    cost_model: CostModel


@runtime_checkable
class BatchedCostModel(CostModel, Protocol):
    """A cost model that predicts many microbatches of one batch in one call
    (:func:`dflop_ds.cost.batched.microbatch_costs` asks it; any other model is asked once per microbatch)."""

    def predict_microbatches(self, groups: Microbatches) -> np.ndarray:
        """``(n, k)``: row ``j`` is :meth:`predict_microbatch` of microbatch ``j`` of ``groups``."""
        ...


@runtime_checkable
class PositionalCostModel(CostModel, Protocol):
    """A cost model that costs the microbatches of one batch from their samples' positions, each
    sample's share looked up once for the batch (:func:`dflop_ds.cost.batched.microbatch_cost_by_position`
    asks it; any other model is asked with the microbatch's shapes): for a splitter that costs
    thousands of groupings of one batch."""

    def microbatch_cost_by_position(self, shapes: Sequence[SampleShape]) -> Callable[[Sequence[int]], np.ndarray]:
        """A function of positions in ``shapes`` giving :meth:`predict_microbatch` of those samples."""
        ...


@runtime_checkable
class LayeredCostModel(CostModel, Protocol):
    """A cost model that knows the architecture it predicts: its depths and how each segment's
    time divides over its layers (:func:`dflop_ds.plan.stages.segment_layer_shares`)."""

    @property
    def encoder_layers(self) -> int:
        """Encoder depth the predictions refer to (the projector comes on top)."""
        ...

    @property
    def llm_layers(self) -> int:
        """LLM depth the predictions refer to."""
        ...

    @property
    def layer_shares(self) -> dict[str, list[float]] | None:
        """Each layer's share of its segment's time, ``"encoder"`` over the encoder layers plus
        the projector (last), ``"llm"`` over the LLM layers; None: not known (the layers share equally)."""
        ...


@runtime_checkable
class PlannerCostModel(LayeredCostModel, Protocol):
    """What the planner reads from a cost model beyond :class:`LayeredCostModel` (docs/architecture.md)."""

    @property
    def name(self) -> str:
        """Label in plans and printouts."""
        ...

    @property
    def param_bytes(self) -> Mapping[str, float]:
        """Weight bytes of ``"encoder"``, ``"projector"`` and ``"llm"`` (the planner adds
        gradients and optimizer states)."""
        ...

    @property
    def hidden_bytes_per_token(self) -> float:
        """Bytes sent between LLM stages per token."""
        ...

    @property
    def encoder_hidden_bytes_per_token(self) -> float:
        """Bytes sent between encoder stages per encoder token."""
        ...

    @property
    def activation_checkpointing(self) -> bool:
        """Whether the model's activation memory assumes every layer is recomputed in backward."""
        ...

    @property
    def tensor_parallel_layers(self) -> bool:
        """Whether the model has layers DeepSpeed AutoTP can shard."""
        ...

    @property
    def forward_fraction(self) -> float:
        """The forward's share of forward+backward time."""
        ...

    @property
    def gpu_memory_bytes(self) -> float | None:
        """The memory of the GPU the model describes; None: not known."""
        ...

    def predict_activation_bytes(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """``(2,)``: activation bytes one microbatch keeps for backward over the full depth."""
        ...

    def predict_working_bytes(self, shapes: Sequence[SampleShape]) -> np.ndarray:
        """``(2,)``: transient bytes of one layer's work for a microbatch, beyond the kept activations."""
        ...


@runtime_checkable
class BatchedPlannerCostModel(PlannerCostModel, BatchedCostModel, Protocol):
    """A planner model that also predicts the bytes of many microbatches in one call."""

    def predict_microbatches_activation_bytes(self, groups: Microbatches) -> np.ndarray:
        """``(n, 2)``: row ``j`` is :meth:`predict_activation_bytes` of microbatch ``j`` of ``groups``."""
        ...

    def predict_microbatches_working_bytes(self, groups: Microbatches) -> np.ndarray:
        """``(n, 2)``: row ``j`` is :meth:`predict_working_bytes` of microbatch ``j`` of ``groups``."""
        ...
